"""Model classes (``EntryClass``) for ``SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_m3.models``; the plugin entry point
makes that variable unnecessary."""
