"""What ``import_dcp`` writes under which name: DCP keys -> ours, in this order:

1. ``exclude``: keys matching a pattern are left out;
2. optimizer param groups are regrouped into our layout, one value ``<P>param_groups`` (a
   list of ``{hyper-parameter: value, "params": [fqn, ...]}``) from either DCP layout:
   torch's nested state dict (``<P>param_groups.<i>.<name>``, with ``<P>param_groups.<i>.params``)
   or a flattened one (torch's ``flatten_optimizer_state_dict``, torchtitan:
   ``<P>param_groups.<fqn>.<name>`` per parameter; parameters with equal values share a group);
3. ``split``: fused tensors are cut into their parts (:mod:`fused_split`), the params lists too;
   then ``rotate_half``: the rows of the tensors it names move from rotated halves to
   interleaved rotary pairs, per head (:mod:`rotary_layout`);
4. ``rename``: the first rule whose pattern prefixes a key replaces that prefix. A parameter
   named in the param groups gets the name its optimizer state gets (``<P>state.<fqn>.``).

Patterns (``exclude`` and both sides of ``rename``) are key prefixes of whole dotted components
(``moe.expert_bias`` matches ``moe.expert_bias`` and ``moe.expert_bias.x``, never
``moe.expert_bias_E``) in which ``*`` stands for one component; each ``*`` of a rule's new
prefix is the component its counterpart matched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from hyper_parallel.core.distributed_checkpoint.dcp_interop.fused_split import FusedSplit, Rows
from hyper_parallel.core.distributed_checkpoint.dcp_interop.rotary_layout import RotateHalf
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, TensorStorageMetadata

__all__ = ["Copy", "KeyPattern", "Made", "RenameRule", "Source", "SplitRows", "map_keys", "plan_import"]

_GROUPS, _STATE, _PARAMS = "param_groups", "state", "params"


class KeyPattern:
    """A key prefix of whole dotted components in which ``*`` stands for one component
    (``layers.*.attention.``; ``moe.expert_bias`` does not match ``moe.expert_bias_E``)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.stars = text.count("*")
        self._regex = re.compile("".join("([^.]+)" if piece == "*" else re.escape(piece)
                                         for piece in re.split(r"(\*)", text)))

    def match(self, key: str) -> Optional[Tuple[int, Tuple[str, ...]]]:
        """Where the matched prefix of ``key`` ends and what each ``*`` matched; None: no match."""
        found = self._regex.match(key)
        if found is None or not (self.text.endswith(".") or not self.text or found.end() == len(key)
                                 or key[found.end()] == "."):
            return None
        return found.end(), found.groups()


@dataclass(frozen=True)
class RenameRule:
    """``OLD=NEW``: a key starting with the pattern ``old`` gets ``new`` in place of that prefix."""

    old: str
    new: str
    pattern: KeyPattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", KeyPattern(self.old))
        if self.new.count("*") not in (0, self.old.count("*")):
            raise ValueError(f"--rename {self.old}={self.new}: NEW has {self.new.count('*')} '*', OLD has "
                             f"{self.old.count('*')}; each '*' of NEW takes what its counterpart in OLD matched")

    @classmethod
    def parse(cls, text: str) -> "RenameRule":
        """``OLD=NEW`` (``=model.`` prefixes every key). Raises ValueError without ``=``."""
        old, sep, new = text.partition("=")
        if not sep:
            raise ValueError(f"--rename takes OLD=NEW (a key prefix and its replacement; '*' matches one "
                             f"dotted component), not {text!r}")
        return cls(old, new)

    def apply(self, key: str) -> Optional[str]:
        """``key`` renamed, or None when the rule does not match it."""
        found = self.pattern.match(key)
        if found is None:
            return None
        end, stars = found
        pieces = self.new.split("*")
        new = pieces[0] + "".join(star + piece for star, piece in zip(stars, pieces[1:])) if len(pieces) > 1 \
            else self.new
        return new + key[end:]


Rule = Union[RenameRule, Tuple[str, str]]


def _rules(rename: Sequence[Rule]) -> List[RenameRule]:
    return [r if isinstance(r, RenameRule) else RenameRule(*r) for r in rename]


def _renamed(key: str, rules: Sequence[RenameRule]) -> str:
    return next((new for new in (rule.apply(key) for rule in rules) if new is not None), key)


def _excluded(key: str, patterns: Sequence[KeyPattern]) -> bool:
    return any(p.match(key) is not None for p in patterns)


@dataclass(frozen=True)
class Copy:
    """A stored DCP tensor or value, imported as it is."""

    key: str


@dataclass(frozen=True)
class SplitRows:
    """A part of a fused DCP tensor: its ``rows`` along dim 0 (:mod:`fused_split`)."""

    key: str
    rows: Rows


@dataclass(frozen=True)
class Made:
    """A value the import makes (regrouped param groups, their params lists)."""

    value: Any


Source = Union[Copy, SplitRows, Made]


def map_keys(keys: Sequence[str], rename: Sequence[Rule] = (), exclude: Sequence[str] = ()) -> Dict[str, str]:
    """{new key: DCP key}: keys matching a pattern of ``exclude`` are left out; the first rule of
    ``rename`` (``(old, new)`` or :class:`RenameRule`) whose pattern prefixes a key replaces that
    prefix (``("", "model.")`` prefixes every key left). Patterns: see the module docstring.

    Raises:
        CheckpointError: two keys map to one name (names both).
    """
    rules, patterns = _rules(rename), [KeyPattern(p) for p in exclude]
    mapped: Dict[str, str] = {}
    for key in keys:
        if not _excluded(key, patterns):
            _add(mapped, _renamed(key, rules), key, key)
    return mapped


def _add(mapped: Dict[str, Any], new: str, source: Any, origin: str, origins: Optional[Dict[str, str]] = None) -> None:
    if new in mapped:
        first = origins[new] if origins is not None else mapped[new]
        raise CheckpointError(f"DCP keys {first!r} and {origin!r} both map to {new!r}: change --rename")
    mapped[new] = source
    if origins is not None:
        origins[new] = origin


# ----------------------------------------------------------------------------- param groups


@dataclass
class _Groups:
    """The param groups of the optimizer whose keys start with ``prefix``: per group its
    hyper-parameters (values, or :class:`Copy` of a tensor) and its parameters' FQNs."""

    prefix: str
    groups: List[Tuple[Dict[str, Any], List[str]]]


def _group_prefixes(keys: Sequence[str]) -> Dict[str, List[str]]:
    """{prefix P: its keys ``P + "param_groups." + ...``} (P ends with "." or is empty)."""
    found: Dict[str, List[str]] = {}
    for key in keys:
        components = key.split(".")
        if _GROUPS in components[:-1]:
            at = components.index(_GROUPS)
            found.setdefault("".join(c + "." for c in components[:at]), []).append(key)
    return found


def _regroup(prefix: str, keys: List[str], metadata: Metadata, read_value: Callable[[str], Any]) -> _Groups:
    head = prefix + _GROUPS + "."
    present = set(keys)
    nested: Dict[int, Dict[str, Any]] = {}
    flat: Dict[str, Dict[str, Any]] = {}
    for key in keys:
        rest = key[len(head):]
        index, _, name = rest.partition(".")
        if index.isdigit() and f"{head}{index}.{_PARAMS}" in present:
            if "." in name:
                raise CheckpointError(f"cannot regroup {key!r}: a param group entry that is a dict; "
                                      f"leave the param groups out (--exclude {head})")
            is_tensor = isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata)
            nested.setdefault(int(index), {})[name] = Copy(key) if is_tensor else read_value(key)
            continue
        fqn, _, name = rest.rpartition(".")
        if not fqn or fqn.isdigit():  # (a group index without its params list)
            raise CheckpointError(f"cannot regroup {key!r}: not <param_groups>.<index>.<name> (with a "
                                  f"<index>.params) nor <param_groups>.<fqn>.<name>; leave it out (--exclude {head})")
        if isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata):
            raise CheckpointError(f"cannot regroup {key!r}: a per-parameter hyper-parameter stored as a tensor; "
                                  f"leave the param groups out (--exclude {head})")
        flat.setdefault(fqn, {})[name] = read_value(key)
    groups: List[Tuple[Dict[str, Any], List[str]]] = []
    for index in sorted(nested):
        entries = nested[index]
        params = entries.pop(_PARAMS)
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise CheckpointError(f"{head}{index}.{_PARAMS} is {params!r}, not a list of parameter names")
        groups.append((entries, list(params)))
    for fqn, entries in flat.items():  # parameters with equal hyper-parameters share a group
        group = next((g for g in groups if g[0] == entries), None)
        if group is None:
            groups.append((entries, [fqn]))
        else:
            group[1].append(fqn)
    return _Groups(prefix, groups)


def _split_fqns(fqns: List[str], split: Sequence[FusedSplit]) -> List[str]:
    out: List[str] = []
    for fqn in fqns:
        parts = next((s.part_keys(fqn) for s in split if s.part_keys(fqn)), [])
        out.extend(parts or [fqn])
    return out


def _emit_groups(found: _Groups, rules: Sequence[RenameRule], split: Sequence[FusedSplit],
                 mapped: Dict[str, Source], origins: Dict[str, str]) -> None:
    key = found.prefix + _GROUPS
    new_key = _renamed(key, rules)
    if new_key != _GROUPS and not new_key.endswith("." + _GROUPS):
        raise CheckpointError(f"the optimizer param groups {key!r} map to {new_key!r}, which does not end in "
                              f"{_GROUPS!r}: change --rename")
    state_head = new_key[:-len(_GROUPS)] + _STATE + "."
    groups = []
    for entries, fqns in found.groups:
        names = []
        for fqn in _split_fqns(fqns, split):
            renamed = _renamed(f"{found.prefix}{_STATE}.{fqn}.", rules)
            if not renamed.startswith(state_head):
                raise CheckpointError(f"the optimizer state of parameter {fqn!r} maps to {renamed!r}..., not under "
                                      f"{state_head!r} where its param group {new_key!r} expects it: change --rename")
            names.append(renamed[len(state_head):-1])
        groups.append((entries, names))
    if not any(isinstance(v, Copy) for entries, _ in groups for v in entries.values()):
        _add(mapped, new_key, Made([{**entries, _PARAMS: names} for entries, names in groups]), key, origins)
        return
    for index, (entries, names) in enumerate(groups):  # tensors in a group: key by key, as our flatten does
        for name, value in entries.items():
            _add(mapped, f"{new_key}.{index}.{name}", value if isinstance(value, Copy) else Made(value),
                 f"{key}.{index}.{name}", origins)
        _add(mapped, f"{new_key}.{index}.{_PARAMS}", Made(names), f"{key}.{index}.{_PARAMS}", origins)


# ----------------------------------------------------------------------------- the whole plan


def plan_import(metadata: Metadata, read_value: Callable[[str], Any], *, rename: Sequence[Rule] = (),
                exclude: Sequence[str] = (), split: Sequence[FusedSplit] = (),
                rotate_half: Sequence[RotateHalf] = ()) -> Dict[str, Source]:
    """{new key: what it is made of} for importing the DCP checkpoint described by
    ``metadata`` (``read_value(key)``: a stored value), in the order of the module docstring.

    Raises:
        CheckpointError: two keys map to one name, a fused tensor's rows do not match
            ``split``, a tensor's rows are not the heads ``rotate_half`` says, param groups that cannot be regrouped or whose names ``rename`` moves
            away from their optimizer state (names the keys).
    """
    rules, patterns = _rules(rename), [KeyPattern(p) for p in exclude]
    keys = [k for k in metadata.state_dict_metadata if not _excluded(k, patterns)]
    prefixes = _group_prefixes(keys)
    found = [_regroup(prefix, group_keys, metadata, read_value) for prefix, group_keys in prefixes.items()]
    grouped = {k for group_keys in prefixes.values() for k in group_keys}
    mapped: Dict[str, Source] = {}
    origins: Dict[str, str] = {}
    for key in keys:
        if key in grouped:
            continue
        for part, source in _split_key(key, metadata, split):
            _add(mapped, _renamed(part, rules), _rotated(part, source, metadata, rotate_half), key, origins)
    for groups in found:
        _emit_groups(groups, rules, split, mapped, origins)
    return mapped


def _split_key(key: str, metadata: Metadata, split: Sequence[FusedSplit]) -> List[Tuple[str, Source]]:
    for rule in split:
        parts = rule.part_keys(key)
        if not parts:
            continue
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata) or not md.size:
            return [(part, Copy(key)) for part in parts]
        return [(part, SplitRows(key, rows)) for part, rows in zip(parts, rule.part_rows(md.size[0], key))]
    return [(key, Copy(key))]


def _rotated(key: str, source: Source, metadata: Metadata, rotate_half: Sequence[RotateHalf]) -> Source:
    """``source`` with its rows in interleaved rotary order when a rule of ``rotate_half`` names ``key``."""
    rule = next((r for r in rotate_half if r.applies(key)), None)
    if rule is None or isinstance(source, Made):
        return source
    md = metadata.state_dict_metadata[source.key]
    if not isinstance(md, TensorStorageMetadata) or not md.size:
        return source
    rows = source.rows if isinstance(source, SplitRows) else ((0, md.size[0]),)
    return SplitRows(source.key, rule.permuted(rows, key))
