"""Prebuilt C launchers in packs (warmreg._triton.launchers): the same source and cache key Triton
3.6.0 uses, carried per Python ABI, verified, and installed only where they fit. From Triton 3.7 on
there is no launcher per kernel: packs carry none and say so."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import triton
import triton.backends.nvidia.driver as nvd
from triton.runtime.cache import get_cache_manager

import warmreg
from tests.helpers import CONFIG, Plugin, Scale, _scale_kernel
from warmreg import _triton
from warmreg._triton import launchers as _triton_launchers
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs
from warmreg.stages import pack_format as _pack_format
from warmreg.stages.pack import PackError
from warmreg.values.platform import Platform

H100 = Platform.parse("cuda:90")
ONLY_36 = pytest.mark.skipif(
    not _triton_launchers.PER_KERNEL,
    reason=f"Triton {triton.__version__} builds no C launcher per kernel (3.7+): packs carry none",
)
PY312 = next(iter(sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), None) or shutil.which("python3.12")


class _Captured(Exception):
    pass


@ONLY_36
def test_launcher_source_and_key_are_the_ones_triton_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    with _triton.cross_target(H100):
        x = torch.empty(64, device="meta")
        compiled = _scale_kernel.warmup(x, x, 64, 2.0, BLOCK=64, grid=(1,))
    seen: dict[str, str] = {}

    def capture(src: str, name: str, **_: object) -> None:
        seen["src"], seen["name"] = src, name
        raise _Captured

    monkeypatch.setattr(nvd, "compile_module_from_src", capture)
    monkeypatch.setattr(nvd, "library_dirs", lambda: [])  # it looks for libcuda.so.1, absent without a GPU
    with pytest.raises(_Captured):
        nvd.CudaLauncher(compiled.src, compiled.metadata)
    key, src = _triton_launchers.launcher_source(compiled)
    assert src == seen["src"] and seen["name"] == "__triton_launcher"
    import hashlib

    from triton.runtime.build import platform_key

    assert key == hashlib.sha256((seen["src"] + platform_key()).encode()).hexdigest()


@pytest.fixture
def with_launchers(tmp_path: Path) -> Path:
    out = tmp_path / "scale.tar"
    pythons = [None, PY312] if PY312 else [None]
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2, launcher_pythons=pythons)
    return out


@ONLY_36
def test_a_pack_carries_one_launcher_per_signature_and_python(with_launchers: Path) -> None:
    manifest = packs.verify(with_launchers)
    here = _triton_launchers.local_abi()
    mine = [x for x in manifest.launchers if x.file.name.endswith(here.ext_suffix)]
    assert len(mine) == 2  # three keys, two signatures (n == 1 is a constexpr), hence two launchers
    assert {x.python for x in manifest.launchers} == ({here.version, "3.12"} if PY312 else {here.version})
    with tarfile.open(with_launchers) as tar:
        data = tar.extractfile(mine[0].member()).read()  # type: ignore[union-attr]
    assert data.startswith(b"\x7fELF") and b"libcuda.so.1" in data  # links the driver by soname


@ONLY_36
def test_install_puts_the_fitting_launcher_where_triton_looks(with_launchers: Path, triton_cache: Path) -> None:
    manifest = packs.inspect_pack(with_launchers)
    report = packs.install(with_launchers)
    assert report.installed == 3 and report.launchers == 2
    fitting = [x for x in manifest.launchers if _triton_launchers.fits_here(x.platform_key, x.file.name)]
    assert len(fitting) == 2
    for x in fitting:
        path = get_cache_manager(x.cache_key).get_file(x.file.name)
        assert path is not None and Path(path).is_relative_to(triton_cache)
    others = [x for x in manifest.launchers if x not in fitting]
    assert all(get_cache_manager(x.cache_key).get_file(x.file.name) is None for x in others)
    assert packs.install(with_launchers).launchers == 0  # already there


@ONLY_36
def test_a_corrupt_launcher_is_refused_before_anything_is_written(with_launchers: Path, tmp_path: Path, triton_cache: Path) -> None:
    unpacked = tmp_path / "unpacked"
    with tarfile.open(with_launchers) as tar:
        tar.extractall(unpacked, filter="data")
    manifest = packs.inspect_pack(unpacked)
    here = next(x for x in manifest.launchers if _triton_launchers.fits_here(x.platform_key, x.file.name))
    target = unpacked / here.member()
    data = bytearray(target.read_bytes())
    data[200] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(PackError, match=r"launchers/.*does not match its sha256"):
        packs.verify(unpacked)
    with pytest.raises(PackError, match="does not match its sha256"):
        packs.install(unpacked)
    assert not [p for p in triton_cache.rglob("*") if p.is_file()]


def test_a_format_1_pack_without_launchers_still_installs(tmp_path: Path, triton_cache: Path) -> None:
    out = tmp_path / "old"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False, launcher_pythons=[])
    doc = json.loads((out / "manifest.json").read_text())
    body = {k: v for k, v in doc["body"].items() if k != "launchers"}
    body["format"] = 1
    doc = {"body": body, "sha256": _pack_format._sha256(_pack_format._canonical(body))}
    (out / "manifest.json").write_text(json.dumps(doc))
    report = packs.install(out)
    assert report.installed == 1 and report.launchers == 0


@ONLY_36
def test_an_interpreter_without_headers_is_named(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="no-such-python"):
        packs_build.build(CONFIG, tmp_path / "p", target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False,
                    launcher_pythons=["no-such-python"])  # fmt: skip
    assert not (tmp_path / "p").exists()


@pytest.mark.gpu
def test_gpu_warm_from_a_pack_with_launchers_runs_no_c_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import triton.runtime.build as tb

    out = tmp_path / "local.tar"
    packs_build.build(CONFIG, out, plugins=[Plugin(Scale())], entry_points=False)  # the local GPU, this Python
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    _triton.forget_compiled()
    builds: list[str] = []
    real = tb._build
    monkeypatch.setattr(tb, "_build", lambda name, *a, **k: builds.append(name) or real(name, *a, **k))
    report = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False, pack=out)
    assert report.compiled == 0 and report.ok
    assert builds == []  # launchers came from the pack
    scale = Scale()
    x = torch.randn(48, device="cuda", dtype=torch.float16)  # the key of size 16: div16, fp16
    with warmreg.monitor("error"):
        torch.testing.assert_close(scale(x, 2.0), x * 2.0)


@ONLY_36
def test_built_here_reads_back_the_launchers_the_cache_holds_for_this_python() -> None:
    import torch

    with _triton.cross_target(H100):
        compiled = [
            _scale_kernel.warmup(x, x, n, 2.0, BLOCK=64, grid=(1,))
            for x, n in [(torch.empty(64, device="meta"), 64), (torch.empty(64, device="meta"), 1), (torch.empty(64, device="meta", dtype=torch.float16), 17)]
        ]
    keys = [_triton_launchers.launcher_source(c)[0] for c in compiled]
    assert keys[0] == keys[2] != keys[1]  # n == 1 is a constant (another launcher); dtype and divisibility are not
    assert _triton_launchers.built_here(compiled) == []  # nothing built yet
    name = f"__triton_launcher{_triton_launchers.local_abi().ext_suffix}"
    get_cache_manager(keys[1]).put(b"\x7fELF launcher", name, binary=True)
    get_cache_manager(keys[0]).put(b"\x7fELF other abi", "__triton_launcher.cpython-399-x86_64-linux-gnu.so", binary=True)
    (found,) = _triton_launchers.built_here(compiled)
    assert (found.cache_key, found.name, found.data) == (keys[1], name, b"\x7fELF launcher")
    assert _triton_launchers.fits_here(found.platform_key, found.name)


@pytest.mark.skipif(_triton_launchers.PER_KERNEL, reason="Triton 3.6 builds a C launcher per kernel: packs carry them")
def test_without_per_kernel_launchers_a_pack_carries_none_and_says_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "scale.tar"
    manifest = packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2, launcher_pythons=[None])
    assert manifest.launchers == () and manifest.triton_version == triton.__version__
    with tarfile.open(out) as tar:
        assert not [m for m in tar.getnames() if m.startswith("launchers/")]
    shown = subprocess.run([sys.executable, "-m", "warmreg", "pack", "inspect", str(out)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and f"no C launchers: Triton {triton.__version__} builds none per kernel" in shown.stdout
    assert _triton_launchers.built_here([]) == [] and _triton_launchers.build([], [None]) == []


@ONLY_36
def test_inside_the_block_each_launcher_source_is_generated_and_loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a warm's loads do (CudaLauncher per kernel), with Triton's generation and module load counted."""
    import torch

    with _triton.cross_target(H100):
        x, h = torch.empty(64, device="meta"), torch.empty(64, device="meta", dtype=torch.float16)
        compiled = [_scale_kernel.warmup(*a, 2.0, BLOCK=b, grid=(1,)) for a, b in [((x, x, 64), 64), ((h, h, 17), 64), ((x, x, 1), 64), ((x, x, 64), 128)]]
    made: list[str] = []
    loaded: list[tuple[str, str]] = []
    original_make = nvd.make_launcher

    def make(constants: dict, signature: dict, tensordesc_meta: object) -> str:
        made.append(original_make(constants, signature, tensordesc_meta))
        return made[-1]

    def load(src: str, name: str, **_: object) -> object:
        loaded.append((src, name))
        return type("Module", (), {"launch": staticmethod(lambda *a: None), "src": src})

    monkeypatch.setattr(nvd, "make_launcher", make)
    monkeypatch.setattr(nvd, "compile_module_from_src", load)
    monkeypatch.setattr(nvd, "library_dirs", lambda: [])  # it looks for libcuda.so.1, absent without a GPU
    monkeypatch.setattr(_triton_launchers, "_SOURCES", {})
    expected = [_triton_launchers.launcher_source(c)[1] for c in compiled]
    assert len(set(expected)) == 2  # fp32/fp16, 64/17 and BLOCK 64/128 share one source; n == 1 is a constant
    assert len(made) == 4  # generated once per distinct arguments (constants and signature)
    assert [_triton_launchers.launcher_source(c)[1] for c in compiled] == expected and len(made) == 4
    with _triton.shared_kernel_objects():
        with _triton.shared_kernel_objects():  # nested, as a warm inside a warm's scope
            launchers = [nvd.CudaLauncher(c.src, c.metadata) for c in compiled]
        assert nvd.make_launcher is not make  # still shared until the outer block ends
    assert (nvd.make_launcher, nvd.compile_module_from_src) == (make, load)  # Triton as it was
    assert len(made) == 4 and len(loaded) == 2  # the sources already generated, one load per source
    assert sorted(src for src, _ in loaded) == sorted(set(expected))
    same = [launchers[i] for i, src in enumerate(expected) if src == expected[0]]
    assert len(same) == 3 and all(launcher.launch is same[0].launch for launcher in same)  # one module serves them
    again = nvd.CudaLauncher(compiled[0].src, compiled[0].metadata)  # outside the block: Triton's own path
    assert len(made) == 5 and len(loaded) == 3 and again.launch is not same[0].launch
