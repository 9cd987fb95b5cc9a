"""The speculation methods, one line each, and how names, settings and command-line spellings find them.

Every other part of specserve (the config readers, the command line, the bench, the server, training) asks this
module; none of them names a method.
"""

from __future__ import annotations

from specserve.checks import ConfigError
from specserve.speculative.base import MethodEntry
from specserve.speculative.dflash_draft import DFLASH
from specserve.speculative.draft_model import DRAFT_MODEL
from specserve.speculative.eagle_draft import EAGLE1, EAGLE2, EAGLE3
from specserve.speculative.medusa_draft import MEDUSA
from specserve.speculative.ngram import NGRAM
from specserve.speculative.suffix import SUFFIX

METHODS: tuple[MethodEntry, ...] = (
    NGRAM,
    SUFFIX,
    DRAFT_MODEL,
    MEDUSA,
    EAGLE1,
    EAGLE2,
    EAGLE3,
    DFLASH,
)
PLAIN = "ar"  # no speculation: plain autoregressive decoding
PLAIN_SPELLINGS = (PLAIN, "none", "base")
DEFAULT_METHOD = NGRAM.name  # `specserve serve` with no model.yaml, the bench by default: nothing to train or download

BY_NAME = {entry.name: entry for entry in METHODS}
BY_SPELLING = {spelling: entry for entry in METHODS for spelling in (entry.name, *entry.aliases)}
BY_VLLM_SPELLING = {spelling: entry for entry in METHODS for spelling in entry.vllm}


def normalize(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


def resolve(name: str) -> MethodEntry | None:
    """A method as any vendor spells it (NGram, Draft_Target, draft_model, standalone, Eagle3, ...); None: plain
    decoding."""
    key = normalize(name)
    if key in PLAIN_SPELLINGS:
        return None
    if key not in BY_SPELLING:
        supported = ", ".join(entry.trtllm for entry in METHODS if entry.trtllm)
        raise ConfigError(f"unknown decoding_type {name!r}; supported: {supported}")
    return BY_SPELLING[key]


def resolve_vllm(name: str, where: str) -> MethodEntry:
    """A vLLM `method` (vLLM's spellings first: its `eagle` drafts a dynamic tree)."""
    key = str(name).strip().lower()
    entry = BY_VLLM_SPELLING.get(key) or BY_SPELLING.get(normalize(key))
    if entry is None:
        supported = [spelling for entry in METHODS for spelling in entry.vllm[:1]]
        raise ConfigError(f"{where}: speculative method {name!r} is not supported; use "
                          f"{', '.join(supported[:-1])} or {supported[-1]}")
    return entry


def method_for_model(path: str, entry: MethodEntry | None = None) -> MethodEntry:
    """The method a vLLM draft `model` serves: the one whose head the directory holds, else `entry` (default: the
    method that drafts with any checkpoint)."""
    entry = entry or next(e for e in METHODS if e.any_model)
    if not entry.any_model:
        return entry
    return next((e for e in METHODS if e.holds_head and e.holds_head(path)), entry)


def parse_method(text: str) -> tuple[MethodEntry | None, dict]:
    """A command-line method -> (entry, the settings its name implies): 'eagle3+ngram' turns on eagle3's lookup
    branch, 'eagle3+suffix' its suffix branch, 'eagle3' turns both off."""
    base, plus, extra = str(text).partition("+")
    entry = resolve(base)
    if entry is None or not entry.combines:
        if plus:
            raise ConfigError(f"unknown method {text!r}: {combination_hint()}")
        return entry, {}
    chosen = next((setting for other, setting in entry.combines
                   if normalize(extra) in (other.name, *other.aliases)), None)
    if plus and chosen is None:
        raise ConfigError(f"unknown method {text!r}: {combination_hint()}")
    return entry, {setting: setting == chosen for _, setting in entry.combines}


def combination_hint() -> str:
    combining = [entry for entry in METHODS if entry.combines]
    others = [other.name for other, _ in combining[-1].combines]
    names = [entry.name for entry in combining]
    hint = f"'+{others[0]}' follows {', '.join(names[:-1])} or {names[-1]} (e.g. {names[-1]}+{others[0]})"
    more = [f"'+{other}'" for other in others[1:]]
    return hint + (f"; so do{'es' if len(more) == 1 else ''} {', '.join(more)}" if more else "")


def label(text: str) -> str:
    """A command-line method in its canonical spelling (Eagle3+prompt_lookup -> eagle3+ngram)."""
    entry, settings = parse_method(text)
    if entry is None:
        return PLAIN
    chosen = next((other.name for other, setting in entry.combines if settings.get(setting)), None)
    return f"{entry.name}+{chosen}" if chosen else entry.name


def setting_keys() -> set[str]:
    """Every speculative_config key some method reads."""
    return set().union(*(entry.options.KEYS for entry in METHODS))


def vllm_setting_keys() -> set[str]:
    """Every speculative_config key of vLLM's own that some method reads (beyond the common ones)."""
    return set().union(*(entry.vllm_keys for entry in METHODS))


def check_exclusive(entry: MethodEntry | None, settings: dict) -> None:
    """A key that only another method understands, and that would change what it does, is an error."""
    own = entry.options.KEYS if entry else frozenset()
    for other in METHODS:
        for key, owner in other.options.EXCLUSIVE.items():
            if key not in own and settings.get(key):
                raise ConfigError(f"{key} is for {owner}")


def for_training(kind: str) -> MethodEntry:
    return next(entry for entry in METHODS if entry.trains == kind)


def train_kinds() -> list[str]:
    return [entry.trains for entry in METHODS if entry.trains]


def sized_tree_methods() -> list[str]:
    return [entry.name for entry in METHODS if entry.sized_trees]


def method_names() -> list[str]:
    return [PLAIN] + [entry.name for entry in METHODS]


def method_help() -> str:
    """The command line's list of methods."""
    names = [f"{PLAIN} (plain decoding)"] + method_names()[1:]
    combines = next(entry.combines for entry in METHODS if entry.combines)
    turns_on = ", ".join(f"+{other.name}: {setting}" for other, setting in combines)
    return f"{', '.join(names[:-1])} or {names[-1]}; {combination_hint()} ({turns_on})"


def model_help() -> str:
    drafts = [entry.name for entry in METHODS if entry.any_model]
    heads = [entry.name for entry in METHODS if entry.model_needed and not entry.any_model]
    return f"Draft model ({', '.join(drafts)}) or head directory ({', '.join(heads)})."
