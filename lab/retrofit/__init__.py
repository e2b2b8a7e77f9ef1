"""An MSA indexer retrofitted to a real small LM (SmolLM2-135M): evidence for the index-K format choice."""
