"""The pack format: manifest, entries, files and prebuilt launchers as attrs values, the one path rule
for names a pack supplies, the limits on what is read, and the manifest's validation
(see :mod:`warmreg.stages.pack`; the reader is :mod:`warmreg.stages.pack_reader`).

Everything in a manifest is data from whoever made the pack. It is checked here, field by field,
before any of it is used: types, ranges, hex digests, and every name by :func:`check_name`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import attrs

from ..support import bounded_json as _json
from ..values.errors import PackError

__all__ = [
    "FORMAT", "LIMITS", "Limits", "Manifest", "PackChoice", "PackEntry", "PackError", "PackFile", "PackLauncher", "check_name",
    "parse_manifest",
]  # fmt: skip

FORMAT = 2  # 2: optional prebuilt C launchers (format 1 packs still install)
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")


@attrs.frozen(kw_only=True)
class Limits:
    """What a reader reads at most (each documented in the README's trust model)."""

    member: int = 256 * 1024 * 1024  # one file of a pack
    manifest: int = 32 * 1024 * 1024  # manifest.json
    total: int = 2 * 1024 * 1024 * 1024  # all files a manifest lists, together
    entries: int = 10_000
    launchers: int = 1_000
    members: int = 25_000  # members of an archive (listed or not): two files per entry, launchers
    files_per_entry: int = 16
    choices: int = 10_000  # autotune choices
    candidates: int = 64  # autotune candidates of one kernel


LIMITS = Limits()

#: The path rule: a name a pack supplies (a file name, a binary hash, a launcher key) is one relative
#: component of these characters, never "." or "..", and is only ever joined as that one component.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_HEX = re.compile(r"[0-9a-f]{16,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_<][A-Za-z0-9_<>]*)*")
_FIX = "do not use this pack; rebuild it with warmreg build"


def check_name(name: object, what: str, pack: str) -> str:
    """``name`` if it obeys the path rule (one component of ``[A-Za-z0-9_.+-]``, not starting with a dot).

    :raises PackError: naming ``what`` and the name otherwise.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name)[:80] if isinstance(name, str) else f"a {type(name).__name__}"
        raise PackError(pack, f"{what} {shown} is not a safe name (one path component of letters, digits and _.+-)", fix=_FIX)
    return name


def _files(items: Any) -> tuple[PackFile, ...]:
    return tuple(items)


def _launchers(items: Any) -> tuple[PackLauncher, ...]:
    return tuple(items)


def _entries(items: Any) -> tuple[PackEntry, ...]:
    return tuple(items)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@attrs.frozen
class PackFile:
    """One binary or metadata file of an entry."""

    name: str
    size: int
    sha256: str


@attrs.frozen(kw_only=True)
class PackEntry:
    """One compiled key: what it is, where it came from, and its files."""

    kernel: str
    key: dict[str, Any] = attrs.field(eq=False)
    jit_name: str
    source_hash: str
    specialization_data: str
    binary_hash: str
    files: tuple[PackFile, ...] = attrs.field(converter=_files)

    def member(self, file: PackFile) -> str:
        return f"files/{self.binary_hash}/{file.name}"

    def metadata(self) -> PackFile:
        """The entry's Triton metadata file (its one ``.json``; the manifest check guarantees it)."""
        return next(f for f in self.files if f.name.endswith(".json"))


@attrs.frozen(kw_only=True)
class PackLauncher:
    """A C launcher Triton would otherwise build on the serving host, for one Python ABI."""

    cache_key: str  # Triton's: sha256(launcher source + platform key)
    platform_key: str
    python: str
    file: PackFile

    def member(self) -> str:
        return f"launchers/{self.cache_key}/{self.file.name}"


@attrs.frozen(kw_only=True)
class PackChoice:
    """The autotune candidate chosen for one tuning key on a GPU (``device``, its name)."""

    kernel: str
    key: dict[str, Any] = attrs.field(eq=False)
    config: int
    candidates: tuple[str, ...] = attrs.field(converter=lambda xs: tuple(str(x) for x in xs))
    device: str


def _choices(items: Any) -> tuple[PackChoice, ...]:
    return tuple(items)


@attrs.frozen(kw_only=True)
class Manifest:
    """The manifest of a pack."""

    format: int
    warmreg_version: str
    triton_version: str
    ptxas_version: str | None
    target: str
    python: str
    created: float
    model_type: str
    entries: tuple[PackEntry, ...] = attrs.field(converter=_entries)
    complete: bool = True
    launchers: tuple[PackLauncher, ...] = attrs.field(default=(), converter=_launchers)
    tuning: tuple[PackChoice, ...] = attrs.field(default=(), converter=_choices)
    #: the environment knobs of the build that enter Triton's cache key or numerics (``cache_knobs()``);
    #: empty in a pack of an older warmreg, which did not record them
    knobs: dict[str, str] = attrs.field(factory=dict, converter=lambda items: {str(k): str(v) for k, v in dict(items).items()})
    #: a pack of an engine's own kernels (:func:`warmreg.record_pack`): the engine's ``name`` and ``version``, and
    #: what else its builder records (the GPU profile, kernels held and not held); ``None`` for a pack of plugin
    #: kernels, whose manifest then reads as before. Its entries' ``key`` is the engine's key, as text.
    engine: dict[str, Any] | None = attrs.field(default=None, eq=False)

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self)
        body["entries"] = [attrs.asdict(e) for e in self.entries]
        body["launchers"] = [attrs.asdict(x) for x in self.launchers]
        body["tuning"] = [{**attrs.asdict(c), "candidates": list(c.candidates)} for c in self.tuning]
        if not self.tuning:
            del body["tuning"]  # a pack without autotuned kernels reads as before
        if not self.knobs:
            del body["knobs"]
        if self.engine is None:
            del body["engine"]
        return {"body": body, "sha256": _sha256(_canonical(body))}

    @classmethod
    def from_json(cls, data: Any, pack: str) -> Manifest:
        """Validate a parsed ``manifest.json`` completely and build the manifest.

        :raises PackError: naming the first field that is wrong.
        """
        if not isinstance(data, dict) or not isinstance(data.get("body"), dict) or not isinstance(data.get("sha256"), str):
            raise PackError(pack, "manifest.json is not a warmreg manifest", fix="rebuild the pack with warmreg build")
        body = data["body"]
        if _sha256(_canonical(body)) != data["sha256"]:
            raise PackError(pack, "manifest.json was edited (its digest does not match)", fix="rebuild the pack")
        if not isinstance(body.get("format"), int) or isinstance(body["format"], bool) or body["format"] > FORMAT:
            raise PackError(
                pack, f"was written by a newer warmreg (format {body.get('format')!r:.20}, this warmreg reads {FORMAT})", fix="upgrade warmreg"
            )
        if body.get("complete") is not True:
            raise PackError(pack, "is incomplete (no completion marker)", fix="rebuild the pack")
        return _Check(pack).manifest(body)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(raw: bytes, pack: str) -> Manifest:
    """Parse and validate ``manifest.json`` (bounded in size, nesting and values).

    :raises PackError: if it is not JSON, over a bound, or not a valid manifest.
    """
    try:
        data = _json.loads(raw)
    except ValueError as exc:
        raise PackError(pack, f"manifest.json is not JSON warmreg reads ({_one_line(exc)})", fix="rebuild the pack") from exc
    return Manifest.from_json(data, pack)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


#: an environment knob's name: Triton's variable names and the adapter's ``default_fp_fusion``
_KNOB = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_SPEC_KEYS = {"signature": dict, "constant_keys": list, "constant_vals": list, "attrs_keys": list, "attrs_vals": list, "options": dict}


class _Check:
    """Field-by-field validation of a manifest body; every message names the field."""

    def __init__(self, pack: str) -> None:
        self.pack = pack

    def fail(self, where: str, problem: str) -> PackError:
        return PackError(self.pack, f"manifest.json: {where} {problem}", fix=_FIX)

    def fields(self, obj: Any, where: str, required: set[str], optional: frozenset[str] = frozenset()) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(where, f"must be an object (got {type(obj).__name__})")
        missing, extra = required - set(obj), set(obj) - required - optional
        if missing or extra:
            raise self.fail(where, f"has a malformed entry (missing {sorted(missing)}, unknown {sorted(extra)[:5]})")
        return obj

    def string(self, value: Any, where: str, *, pattern: re.Pattern[str] | None = None, limit: int = 256) -> str:
        if not isinstance(value, str) or len(value) > limit or (pattern is not None and not pattern.fullmatch(value)):
            shown = repr(value)[:60] if isinstance(value, str) else f"a {type(value).__name__}"
            raise self.fail(where, f"must be {'a well-formed' if pattern else 'a'} string of at most {limit} characters (got {shown})")
        return value

    def integer(self, value: Any, where: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(where, f"must be an int in {low}..{high} (got {repr(value)[:40]})")
        return value

    def items(self, value: Any, where: str, limit: int) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list (got {type(value).__name__})")
        if len(value) > limit:
            raise PackError(self.pack, f"lists {len(value)} {where}, more than the {limit} this warmreg reads", fix="split the pack")
        return value

    def file(self, obj: Any, where: str) -> PackFile:
        f = self.fields(obj, where, {"name", "size", "sha256"})
        check_name(f["name"], f"{where}.name", self.pack)
        if f["size"] == 0:
            raise self.fail(f"{where}.size", "is 0: warmreg refuses empty files")
        size = self.integer(f["size"], f"{where}.size", 1, LIMITS.member)
        return PackFile(f["name"], size, self.string(f["sha256"], f"{where}.sha256", pattern=_SHA256))

    def entry(self, obj: Any, where: str) -> PackEntry:
        e = self.fields(obj, where, {"kernel", "key", "jit_name", "source_hash", "specialization_data", "binary_hash", "files"})
        files = [self.file(f, f"{where}.files[{i}]") for i, f in enumerate(self.items(e["files"], f"{where}.files", LIMITS.files_per_entry))]
        names = [f.name for f in files]
        if sum(n.endswith(".json") for n in names) != 1 or len(set(names)) != len(names):
            raise self.fail(f"{where}.files", f"must name one .json metadata file and no name twice (got {names[:4]})")
        if not isinstance(e["key"], dict) or not isinstance(e["key"].get("type"), str) or not isinstance(e["key"].get("fields"), dict):
            raise self.fail(f"{where}.key", "must be a serialized compile key {type, fields}")
        spec = self.string(e["specialization_data"], f"{where}.specialization_data", limit=1 << 20)
        try:
            parsed = _json.loads(spec, max_depth=16, max_values=100_000)
        except ValueError as exc:
            raise self.fail(f"{where}.specialization_data", f"is not JSON warmreg reads ({_one_line(exc)})") from exc
        if not isinstance(parsed, dict) or any(not isinstance(parsed.get(k), t) for k, t in _SPEC_KEYS.items()):
            raise self.fail(f"{where}.specialization_data", "is not Triton's serialized specialization")
        return PackEntry(
            kernel=self.string(e["kernel"], f"{where}.kernel"),
            key=e["key"],
            jit_name=self.string(e["jit_name"], f"{where}.jit_name", pattern=_DOTTED, limit=512),
            source_hash=self.string(e["source_hash"], f"{where}.source_hash", limit=128),
            specialization_data=spec,
            binary_hash=check_name(self.string(e["binary_hash"], f"{where}.binary_hash", pattern=_HEX), f"{where}.binary_hash", self.pack),
            files=files,
        )

    def launcher(self, obj: Any, where: str) -> PackLauncher:
        x = self.fields(obj, where, {"cache_key", "platform_key", "python", "file"})
        return PackLauncher(
            cache_key=self.string(x["cache_key"], f"{where}.cache_key", pattern=_HEX),  # hex: also a safe name
            platform_key=self.string(x["platform_key"], f"{where}.platform_key"),
            python=self.string(x["python"], f"{where}.python", limit=32),
            file=self.file(x["file"], f"{where}.file"),
        )

    def choice(self, obj: Any, where: str) -> PackChoice:
        c = self.fields(obj, where, {"kernel", "key", "config", "candidates", "device"})
        if not isinstance(c["key"], dict) or not isinstance(c["key"].get("type"), str) or not isinstance(c["key"].get("fields"), dict):
            raise self.fail(f"{where}.key", "must be a serialized compile key {type, fields}")
        candidates = [self.string(x, f"{where}.candidates[{i}]", limit=1024) for i, x in enumerate(self.items(c["candidates"], f"{where}.candidates", LIMITS.candidates))]
        return PackChoice(
            kernel=self.string(c["kernel"], f"{where}.kernel"), key=c["key"],
            config=self.integer(c["config"], f"{where}.config", 0, max(len(candidates) - 1, 0)),
            candidates=candidates, device=self.string(c["device"], f"{where}.device"),
        )  # fmt: skip

    def manifest(self, body: dict[str, Any]) -> Manifest:
        scalars = {"format", "warmreg_version", "triton_version", "ptxas_version", "target", "python", "created", "model_type"}
        b = self.fields(body, "body", scalars | {"entries", "complete"}, frozenset({"launchers", "tuning", "knobs", "engine"}))
        for name in ("warmreg_version", "triton_version", "target", "python", "model_type"):
            self.string(b[name], name)
        if b["ptxas_version"] is not None:
            self.string(b["ptxas_version"], "ptxas_version")
        if isinstance(b["created"], bool) or not isinstance(b["created"], (int, float)):
            raise self.fail("created", "must be a number")
        entries = [self.entry(e, f"entries[{i}]") for i, e in enumerate(self.items(b["entries"], "entries", LIMITS.entries))]
        launchers = [self.launcher(x, f"launchers[{i}]") for i, x in enumerate(self.items(b.get("launchers", []), "launchers", LIMITS.launchers))]
        seen: set[str] = set()
        for member in [e.member(f) for e in entries for f in e.files] + [x.member() for x in launchers]:
            if member in seen:
                raise PackError(self.pack, f"lists {member} twice (duplicate entries or launchers)", fix="rebuild the pack")
            seen.add(member)
        total = sum(f.size for e in entries for f in e.files) + sum(x.file.size for x in launchers)
        if total > LIMITS.total:
            raise PackError(self.pack, f"lists {total} bytes of files, more than the {LIMITS.total} this warmreg reads", fix="split the pack")
        tuning = [self.choice(c, f"tuning[{i}]") for i, c in enumerate(self.items(b.get("tuning", []), "tuning", LIMITS.choices))]
        return Manifest(**{
            **b, "format": self.integer(b["format"], "format", 1, FORMAT), "created": float(b["created"]), "entries": entries,
            "launchers": launchers, "tuning": tuning, "knobs": self.knobs(b.get("knobs", {})),
            "engine": self.engine(b["engine"]) if "engine" in b else None,
        })  # fmt: skip

    def engine(self, obj: Any) -> dict[str, Any]:
        """The engine section: an object naming the engine and its version; the rest is the builder's record,
        shown (escaped) and never acted on."""
        if not isinstance(obj, dict):
            raise self.fail("engine", f"must be an object (got {type(obj).__name__})")
        for name in ("name", "version"):
            self.string(obj.get(name), f"engine.{name}", pattern=_DOTTED if name == "name" else None, limit=64)
        return obj

    def knobs(self, obj: Any) -> dict[str, str]:
        if not isinstance(obj, dict) or len(obj) > 64:
            raise self.fail("knobs", "must be an object of at most 64 settings")
        return {self.string(k, "knobs", pattern=_KNOB): self.string(v, f"knobs.{k}") for k, v in obj.items()}
