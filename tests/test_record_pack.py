"""Packs of compiles an engine's own code runs (``warmreg.record_pack``), their manifest's ``engine`` section, and
the ``warmreg_pack_functions`` hook through which pack install finds an engine's Triton functions.

The engine here is this module: a ``@triton.jit`` function no warmreg kernel class defines, compiled for cuda:90
with ``JITFunction.warmup`` on meta tensors (no GPU), as vLLM's own ``compile(key)`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import warmreg
from warmreg import Platform
from warmreg.stages import pack
from warmreg.stages.pack_format import Manifest, PackError

TARGET = "cuda:90"
ENGINE = {
    "name": "engine",
    "version": "1.2.3",
    "profile": {"gpu": "H200"},
    "not_held": [{"name": "Tuned", "why": "autotuned"}],
}


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # BLOCK: the tile, a constexpr of the binary
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


NAME = f"{_scale_kernel.fn.__module__}.{_scale_kernel.fn.__qualname__}"


def engine_compile(block: int, dtype: torch.dtype = torch.float32) -> None:
    """The engine's own compile of one key: a compile-only warmup on meta tensors."""
    x = torch.empty(100, dtype=dtype, device="meta")
    _scale_kernel.warmup(x, torch.empty_like(x), 100, BLOCK=block, grid=(1,))


def forget() -> None:
    _scale_kernel.device_caches.clear()  # a fresh process: nothing in memory


def record(out: Path, blocks: list[int], **kwargs: Any) -> Manifest:
    forget()
    with warmreg.record_pack(out, target=TARGET, model_type="toy", engine=ENGINE, **kwargs) as recording:
        for block in blocks:
            with recording.key(kernel="Scale", key=f"ScaleKey(block={block})", kind="engine.ScaleKey"):
                engine_compile(block)
        with recording.key(kernel="Scale", key="ScaleKey(block=64, again)", kind="engine.ScaleKey"):
            engine_compile(64)  # the same binary as block 64: in memory, not compiled again
    assert recording.manifest is not None
    return recording.manifest


class EnginePlugin:
    """A plugin of this engine: supplies its function for its own packs only."""

    def __init__(self, answer: dict[str, Any] | None = None, raises: bool = False) -> None:
        self.answer, self.raises = answer, raises
        self.calls: list[tuple[frozenset[str], Any]] = []

    @warmreg.hookimpl
    def warmreg_pack_functions(self, names: frozenset[str], engine: Any) -> dict[str, Any]:
        self.calls.append((names, engine))
        if self.raises:
            raise RuntimeError("the engine cannot be imported here")
        if engine is None or engine["name"] != "engine":
            return {}
        return self.answer if self.answer is not None else {NAME: _scale_kernel}


def test_a_recorded_pack_holds_each_binary_once_with_the_engine_section(tmp_path: Path) -> None:
    manifest = record(tmp_path / "p.tar.gz", [64, 128])
    assert manifest.engine == ENGINE and manifest.target == TARGET and manifest.model_type == "toy"
    assert [(e.kernel, e.key, e.jit_name) for e in manifest.entries] == [
        ("Scale", {"type": "engine.ScaleKey", "fields": {"key": f"ScaleKey(block={b})"}}, NAME) for b in (64, 128)
    ]
    read = pack.inspect_pack(tmp_path / "p.tar.gz")
    assert read.engine == ENGINE and len(read.entries) == 2
    assert {f.name.rsplit(".", 1)[1] for e in read.entries for f in e.files} == {"json", "cubin"}


def test_pack_install_finds_the_engines_functions_through_the_hook(tmp_path: Path, triton_cache: Path) -> None:
    record(tmp_path / "p", [64, 128])
    plugin = EnginePlugin()
    jits = pack.loaded_jits([plugin], entry_points=False, names=frozenset({NAME}), engine=ENGINE)
    assert jits[NAME] is _scale_kernel and plugin.calls == [(frozenset({NAME}), ENGINE)]
    assert pack.verify(tmp_path / "p", jits=jits).engine == ENGINE
    report = pack.install(tmp_path / "p", jits=jits)
    assert (report.installed, report.present, report.refused) == (2, 0, ())
    # the engine's own compile of both keys now finds every binary in the cache: nothing compiles
    hits: list[bool] = []
    forget()
    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    try:
        with warmreg.cross_target(Platform.parse(TARGET)):
            engine_compile(64)
            engine_compile(128)
    finally:
        triton.knobs.compilation.listener = previous
    assert hits == [True, True]


#: the engine's plugin as an installed distribution publishes it (``warmreg`` entry-point group)
INSTALLED_PLUGIN = EnginePlugin()


def test_an_engines_integration_installs_its_pack_without_a_plan(
    tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warmreg.install_engine_pack``: the engine's pack installed through the installed plugins' hook, a prefetch
    of it waited for, a pack of another engine left alone, one for another target refused."""
    import importlib.metadata

    ep = importlib.metadata.EntryPoint(name="engine", value=f"{__name__}:INSTALLED_PLUGIN", group="warmreg")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep] if group == "warmreg" else [])
    record(tmp_path / "p", [64, 128])
    assert warmreg.install_engine_pack(tmp_path / "p", engine="other") is None  # not that engine's: nothing read
    assert not any(triton_cache.iterdir())
    report = warmreg.install_engine_pack(tmp_path / "p", engine="engine")
    assert report is not None and (report.installed, report.present, report.refused) == (2, 0, ())
    assert not report.prefetched
    hits: list[bool] = []
    forget()
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda *, cache_hit, **_: hits.append(cache_hit))
    with warmreg.cross_target(Platform.parse(TARGET)):
        engine_compile(64)
        engine_compile(128)
    assert hits == [True, True]  # the engine's own compile of each key finds its binary
    # a prefetch of the pack (the engine's start-up, before it loads weights) is waited for, not repeated
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second-cache"))
    warmreg.prefetch(pack=tmp_path / "p")
    again = warmreg.install_engine_pack(tmp_path / "p", engine="engine")
    assert again is not None and again.prefetched and (again.installed, again.refused) == (2, ())
    with pytest.raises(PackError, match="targets cuda:90, this warm targets cuda:100"):
        warmreg.install_engine_pack(tmp_path / "p", engine="engine", target="cuda:100")


def test_without_an_answer_from_a_plugin_the_entries_are_refused(tmp_path: Path) -> None:
    record(tmp_path / "p", [64])
    names = frozenset({NAME})
    assert NAME not in pack.loaded_jits([EnginePlugin(raises=True)], entry_points=False, names=names, engine=ENGINE)
    assert NAME not in pack.loaded_jits(
        [EnginePlugin()], entry_points=False, names=names, engine={**ENGINE, "name": "other"}
    )
    # a plugin cannot answer for another function than the one it returns
    wrong = EnginePlugin(answer={"elsewhere.fn": _scale_kernel, NAME: object()})
    assert not {"elsewhere.fn", NAME} & set(
        pack.loaded_jits([wrong], entry_points=False, names=names | {"elsewhere.fn"}, engine=ENGINE)
    )
    report = pack.install(tmp_path / "p", jits={})
    assert report.installed == 0 and "no kernel of the loaded plugins defines" in report.refused[0][1]
    assert report.refused[0][0] == "Scale {'key': 'ScaleKey(block=64)'}"


def test_a_compile_outside_a_labelled_key_or_a_block_without_compiles_writes_nothing(tmp_path: Path) -> None:
    forget()
    with pytest.raises(PackError, match="outside a labelled key"):
        with warmreg.record_pack(tmp_path / "a", target=TARGET, model_type="toy", engine=ENGINE):
            engine_compile(64)
    with pytest.raises(PackError, match="compiled nothing"):
        with warmreg.record_pack(tmp_path / "b", target=TARGET, model_type="toy", engine=ENGINE):
            pass
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    record(tmp_path / "c", [64])
    with pytest.raises(PackError, match="already exists"):
        record(tmp_path / "c", [64])
    assert len(record(tmp_path / "c", [64, 128], force=True).entries) == 2


def _signed(body: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json`` for ``body``, with its digest (as a builder writes it)."""
    from warmreg.stages.pack_format import _canonical, _sha256

    return {"body": body, "sha256": _sha256(_canonical(body))}


def test_a_pack_without_an_engine_reads_as_before_and_a_bad_engine_section_is_named(tmp_path: Path) -> None:
    body = json.loads(json.dumps(record(tmp_path / "p", [64]).to_json()))["body"]
    del body["engine"]  # a plugin pack's manifest, as every warmreg before the engine section wrote it
    old = Manifest.from_json(_signed(body), "old")
    assert old.engine is None and json.loads(json.dumps(old.to_json())) == _signed(body)  # written back the same
    for engine, field in [
        ({"version": "1"}, "engine.name"),
        ({"name": "vllm", "version": 3}, "engine.version"),
        ("vllm", "engine"),
    ]:
        with pytest.raises(PackError, match=f"manifest.json: {field} must be"):
            Manifest.from_json(_signed({**body, "engine": engine}), "bad")
