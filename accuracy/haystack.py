"""A local haystack: seeded, plain English prose written from this module's own word lists.

No downloads. ``sentences(seed)`` yields an endless, deterministic stream of varied sentences
(a farm-and-river chronicle in an old-almanac style); the needle tasks fill a context with them.
"""

import random
from collections.abc import Iterator

_PEOPLE = ["the miller", "the ferryman", "a shepherd", "the widow Hale", "old Tobias", "the schoolmaster",
           "the blacksmith's daughter", "a travelling tinker", "the parson", "two brothers from the ridge",
           "the innkeeper", "a young clerk", "the weaver", "the harbour pilot", "a lame soldier",
           "the carter", "the lamplighter", "a girl with a basket", "the bargeman", "the surveyor"]
_PLACES = ["the mill pond", "the north meadow", "the chalk road", "the church yard", "the orchard wall",
           "the salt marsh", "the low bridge", "the market square", "the beech wood", "the quarry",
           "the tithe barn", "the river bend", "the sheep fold", "the lock gates", "the hill farm",
           "the ferry landing", "the weir", "the common", "the old turnpike", "the cider house"]
_THINGS = ["a lantern", "a bundle of reeds", "a cracked bell", "a sack of barley", "a letter",
           "a brass key", "a coil of rope", "a basket of pears", "a wooden cart", "a length of linen",
           "a ledger", "a clay jug", "a pair of boots", "a fishing net", "a map of the parish",
           "a tin whistle", "a loaf of rye bread", "a bolt of wool", "a copper kettle", "a hay rake"]
_VERBS = ["carried", "mended", "sold", "found", "lost", "painted", "buried", "counted", "weighed",
          "polished", "wrapped", "hid", "borrowed", "returned", "examined", "traded"]
_WEATHER = ["rain came in off the hills", "the frost held until noon", "a warm wind turned the vanes",
            "fog lay thick along the water", "the sky cleared after a week of cloud", "hail beat on the roofs",
            "the river rose a hand's breadth", "the swallows came back early", "snow lay on the high fields",
            "the wells ran low"]
_TIMES = ["In the spring", "Late that autumn", "On a market day", "Before the harvest", "At first light",
          "During the long winter", "Some years before", "In the week of the fair", "By evening",
          "On the feast of the saint"]
_REMARKS = ["Nobody in the village could say why.", "It was talked of for a season and then forgotten.",
            "The parish book records it in a careful hand.", "Some said it was a good omen.",
            "The price of bread did not change.", "The children made a song of it.",
            "It was the last such year anyone remembered.", "The magistrate took no notice.",
            "A fair copy was kept at the inn.", "Many doubted the story."]
_ADJ = ["quiet", "muddy", "long", "cold", "bright", "narrow", "crowded", "empty", "green", "grey"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    who, other = rng.sample(_PEOPLE, 2)
    where, thing = rng.choice(_PLACES), rng.choice(_THINGS)
    if kind == 0:
        return f"{rng.choice(_TIMES)}, {who} {rng.choice(_VERBS)} {thing} near {where}."
    if kind == 1:
        return f"{rng.choice(_TIMES)} {rng.choice(_WEATHER)}, and {who} kept to {where}."
    if kind == 2:
        return f"{who.capitalize()} and {other} walked the {rng.choice(_ADJ)} way past {where} with {thing}."
    if kind == 3:
        return f"It is written that {who} once {rng.choice(_VERBS)} {thing} for {other}. {rng.choice(_REMARKS)}"
    return f"The {rng.choice(_ADJ)} stretch by {where} was where {who} met {other} most evenings."


def sentences(seed: int) -> Iterator[str]:
    """Endless deterministic sentences for ``seed``."""
    rng = random.Random(seed)
    while True:
        yield _sentence(rng)
