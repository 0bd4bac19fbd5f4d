"""Hostile packs (issue 18): one generator per class of attack, each with its own cases. Every case
is answered by ``pack verify`` and ``pack install`` with exit 2 and one line naming the problem, in
with nothing written outside the Triton cache and nothing into it (how fast: benchmarks/cli_refusals.py)."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import CONFIG, Plugin, Scale
from tests.reliability.hostile import (
    Members,
    Pack,
    assert_nothing_written,
    assert_refused,
    edited,
    files_under,
    run_cli,
    write_dir,
    write_tar,
    write_zip,
)
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs

Case = Callable[[Members, Path], tuple[Path, str]]
CASES: dict[str, Case] = {}


def case(cls: str, name: str) -> Callable[[Case], Case]:
    def add(fn: Case) -> Case:
        CASES[f"{cls}: {name}"] = fn
        return fn

    return add


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Members:
    out = tmp_path_factory.mktemp("base") / "pack"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2, launcher_pythons=[])
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _every_entry(change: Callable[[Pack, dict], None]) -> Callable[[Pack], None]:
    def apply(pack: Pack) -> None:
        for entry in pack.entries:
            change(pack, entry)

    return apply


def _tar(tmp: Path, members: Members, **kw: object) -> Path:
    return write_tar(tmp / "hostile.tar", members, **kw)  # type: ignore[arg-type]


# -- 1. a pack writes outside the cache ----------------------------------------------------------

_NAMES = {
    "absolute file name": "{outside}/evil.cubin",
    "dotdot file name": "../../evil.cubin",
    "file name with a subdirectory": "sub/evil.cubin",
    "backslash file name": "..\\..\\evil.cubin",
    "dot file name": ".evil.cubin",
    "empty file name": "",
    "NUL in file name": "evil\x00.cubin",
    "newline in file name": "evil\n.cubin",
}
for _label, _name in _NAMES.items():

    def _make_tar(base: Members, tmp: Path, name: str = _name) -> tuple[Path, str]:
        target = name.format(outside=tmp / "outside")
        members = edited(base, lambda p: p.rename_file(p.entries[0], ".cubin", target))  # the member too
        return _tar(tmp, members), "unsafe path|not a safe name"

    def _make_dir(base: Members, tmp: Path, name: str = _name) -> tuple[Path, str]:
        target = name.format(outside=tmp / "outside")
        members = edited(base, lambda p: p.member_of(p.entries[0], ".cubin")[0].update(name=target))  # the manifest only
        return write_dir(tmp / "hostile", members), "not a safe name"

    case("writes outside the cache", f"{_label} (tar)")(_make_tar)
    case("writes outside the cache", f"{_label} (directory)")(_make_dir)


@case("writes outside the cache", "binary hash that climbs out")
def _hash_climbs(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.entries[0].update(binary_hash="../../../outside"))), "binary_hash"


@case("writes outside the cache", "empty binary hash (files//name)")
def _hash_empty(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.entries[0].update(binary_hash=""))), "binary_hash"


@case("writes outside the cache", "launcher key that climbs out")
def _launcher_climbs(base: Members, tmp: Path) -> tuple[Path, str]:
    launcher = {"cache_key": "../../outside", "platform_key": "x", "python": "3.11", "file": {"name": "x.so", "size": 1, "sha256": "0" * 64}}
    return _tar(tmp, edited(base, lambda p: p.body.update(launchers=[launcher]))), "cache_key"


@case("writes outside the cache", "absolute launcher file name")
def _launcher_abs(base: Members, tmp: Path) -> tuple[Path, str]:
    f = {"name": str(tmp / "outside" / "x.so"), "size": 1, "sha256": "0" * 64}
    launcher = {"cache_key": "a" * 64, "platform_key": "x", "python": "3.11", "file": f}
    return _tar(tmp, edited(base, lambda p: p.body.update(launchers=[launcher]))), "not a safe name"


for _label, _member in {
    "absolute member": "/tmp/evil.cubin",
    "dotdot member": "files/../../evil.cubin",
    "double slash member": "files//evil.cubin",
    "dot component member": "./files/x/evil.cubin",
    "too deep member": "files/a/b/c/evil.cubin",
}.items():

    def _make_member(base: Members, tmp: Path, member: str = _member) -> tuple[Path, str]:
        return _tar(tmp, {**base, member: b"x"}), "unsafe path"

    case("writes outside the cache", _label)(_make_member)


# -- 2. pack data makes warmreg import a module --------------------------------------------------

for _label, _jit in {
    "jit_name of an importable module": "hostile_probe.f",
    "jit_name of a nested attribute": "hostile_probe.sub.f",
    "jit_name of a stdlib module": "this.f",
    "jit_name of a loaded module's other function": "tests.helpers.Plugin",
}.items():

    def _make_jit(base: Members, tmp: Path, jit: str = _jit) -> tuple[Path, str]:
        return _tar(tmp, edited(base, _every_entry(lambda p, e: e.update(jit_name=jit)))), "never imports"

    case("imports a module", _label)(_make_jit)


@case("imports a module", "jit_name that is not a dotted name")
def _jit_call(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.entries[0].update(jit_name="os.system('id')"))), "jit_name"


# -- 3. links -------------------------------------------------------------------------------------


def _cubin(members: Members) -> str:
    return next(n for n in members if n.endswith(".cubin"))


@case("links", "tar symlink member (listed cubin)")
def _tar_symlink(base: Members, tmp: Path) -> tuple[Path, str]:
    name = _cubin(base)

    def link(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)

    return _tar(tmp, {k: v for k, v in base.items() if k != name}, extra=link), "link"


@case("links", "tar hard link member")
def _tar_hardlink(base: Members, tmp: Path) -> tuple[Path, str]:
    def link(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("files/x/extra.cubin")
        info.type, info.linkname = tarfile.LNKTYPE, _cubin(base)
        tar.addfile(info)

    return _tar(tmp, base, extra=link), "link"


@case("links", "tar FIFO member")
def _tar_fifo(base: Members, tmp: Path) -> tuple[Path, str]:
    def fifo(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("files/x/fifo.cubin")
        info.type = tarfile.FIFOTYPE
        tar.addfile(info)

    return _tar(tmp, base, extra=fifo), "special"


@case("links", "zip symlink as a listed cubin")
def _zip_listed(base: Members, tmp: Path) -> tuple[Path, str]:
    return write_zip(tmp / "hostile.zip", base, links={_cubin(base): "/etc/passwd"}), "link"


@case("links", "zip symlink, unlisted")
def _zip_unlisted(base: Members, tmp: Path) -> tuple[Path, str]:
    return write_zip(tmp / "hostile.zip", {**base, "files/x/y.cubin": b""}, links={"files/x/y.cubin": "/etc"}), "link"


@case("links", "directory pack: cubin is a symlink")
def _dir_symlink(base: Members, tmp: Path) -> tuple[Path, str]:
    root = write_dir(tmp / "hostile", base)
    cubin = root / _cubin(base)
    (tmp / "elsewhere.bin").write_bytes(cubin.read_bytes())  # same bytes: only the link is wrong
    cubin.unlink()
    cubin.symlink_to(tmp / "elsewhere.bin")
    return root, "link"


@case("links", "directory pack: entry directory is a symlink")
def _dir_dir_symlink(base: Members, tmp: Path) -> tuple[Path, str]:
    root = write_dir(tmp / "hostile", base)
    entry_dir = (root / _cubin(base)).parent
    entry_dir.rename(tmp / "moved")
    entry_dir.symlink_to(tmp / "moved")
    return root, "link"


@case("links", "directory pack: manifest is a symlink")
def _dir_manifest_link(base: Members, tmp: Path) -> tuple[Path, str]:
    root = write_dir(tmp / "hostile", base)
    (root / "manifest.json").rename(tmp / "manifest.json")
    (root / "manifest.json").symlink_to(tmp / "manifest.json")
    return root, "link"


@case("links", "directory pack: cubin is a FIFO")
def _dir_fifo(base: Members, tmp: Path) -> tuple[Path, str]:
    root = write_dir(tmp / "hostile", base)
    (root / _cubin(base)).unlink()
    os.mkfifo(root / _cubin(base))
    return root, "not a regular file"


# -- 4. zero-byte files ---------------------------------------------------------------------------

for _label, _suffix in {"zero-byte cubin in the manifest": ".cubin", "zero-byte metadata in the manifest": ".json"}.items():

    def _make_zero(base: Members, tmp: Path, suffix: str = _suffix) -> tuple[Path, str]:
        return _tar(tmp, edited(base, lambda p: p.replace_file(p.entries[0], suffix, b""))), "empty files"

    case("zero-byte files", _label)(_make_zero)


@case("zero-byte files", "zero-byte launcher in the manifest")
def _zero_launcher(base: Members, tmp: Path) -> tuple[Path, str]:
    launcher = {"cache_key": "a" * 64, "platform_key": "x", "python": "3.11", "file": {"name": "x.so", "size": 0, "sha256": "0" * 64}}
    return _tar(tmp, edited(base, lambda p: p.body.update(launchers=[launcher]))), "empty files"


@case("zero-byte files", "zero-byte members, manifest unchanged")
def _zero_member(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, {k: (b"" if k.endswith(".cubin") else v) for k, v in base.items()}), "0 bytes"


# -- 5. verify passes, install raised: both now check the same things, before the first write ----

_MALFORMED: dict[str, tuple[Callable[[Pack], None], str]] = {
    "entry without its .json": (_every_entry(lambda p, e: e.update(files=[f for f in e["files"] if not f["name"].endswith(".json")])), ".json"),
    "entry with two .json": (lambda p: p.entries[0]["files"].append(dict(p.entries[0]["files"][1], name="b.json")), ".json"),
    "metadata that is not JSON": (_every_entry(lambda p, e: p.replace_file(e, ".json", b"{not json")), "not JSON"),
    "metadata that is a JSON list": (_every_entry(lambda p, e: p.replace_file(e, ".json", b"[1, 2]")), "JSON object"),
    "metadata that is a JSON string": (_every_entry(lambda p, e: p.replace_file(e, ".json", b'"x"')), "JSON object"),
    "metadata that is not UTF-8": (_every_entry(lambda p, e: p.replace_file(e, ".json", b"\xff\xfe{}")), "not JSON"),
    "non-hex launcher cache key": (
        lambda p: p.body.update(launchers=[{"cache_key": "z" * 64, "platform_key": "x", "python": "3.11", "file": {"name": "x.so", "size": 1, "sha256": "0" * 64}}]),
        "cache_key",
    ),
    "key that is a list": (lambda p: p.entries[0].update(key=[1, 2]), ".key"),
    "files that is an object": (lambda p: p.entries[0].update(files={"a": 1}), ".files"),
    "size that is a string": (lambda p: p.entries[0]["files"][0].update(size="12"), ".size"),
    "size that is a bool": (lambda p: p.entries[0]["files"][0].update(size=True), ".size"),
    "negative size": (lambda p: p.entries[0]["files"][0].update(size=-5), ".size"),
    "size over the member limit": (lambda p: p.entries[0]["files"][0].update(size=1 << 40), ".size"),
    "sha256 that is not hex": (lambda p: p.entries[0]["files"][0].update(sha256="g" * 64), ".sha256"),
    "specialization that is not JSON": (lambda p: p.entries[0].update(specialization_data="{"), "specialization_data"),
    "specialization that is a list": (lambda p: p.entries[0].update(specialization_data="[]"), "specialization_data"),
    "entries that is an object": (lambda p: p.body.update(entries={}), "entries"),
    "unknown field in an entry": (lambda p: p.entries[0].update(extra=1), "unknown"),
    "created that is a string": (lambda p: p.body.update(created="yesterday"), "created"),
    "format that is a bool": (lambda p: p.body.update(format=True), "format"),
    "target that is a number": (lambda p: p.body.update(target=90), "target"),
}
for _label, (_change, _needle) in _MALFORMED.items():

    def _make_malformed(base: Members, tmp: Path, change: Callable[[Pack], None] = _change, needle: str = _needle) -> tuple[Path, str]:
        return _tar(tmp, edited(base, change)), needle

    case("install raised where verify passed", _label)(_make_malformed)


# -- 6. deep JSON ---------------------------------------------------------------------------------


@case("deep JSON", "manifest of 100,000 nested arrays")
def _deep_manifest(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, {**base, "manifest.json": b"[" * 100_000 + b"]" * 100_000}), "levels deep"


@case("deep JSON", "manifest body nested 5,000 deep inside a valid shape")
def _deep_body(base: Members, tmp: Path) -> tuple[Path, str]:
    text = b'{"body": {"x": ' + b"[" * 5000 + b"]" * 5000 + b'}, "sha256": "0"}'
    return _tar(tmp, {**base, "manifest.json": text}), "levels deep"


@case("deep JSON", "metadata nested 100,000 deep (size and sha256 consistent)")
def _deep_meta(base: Members, tmp: Path) -> tuple[Path, str]:
    deep = b"[" * 100_000 + b"]" * 100_000
    return _tar(tmp, edited(base, _every_entry(lambda p, e: p.replace_file(e, ".json", deep)))), "levels deep"


@case("deep JSON", "specialization data nested 100,000 deep")
def _deep_spec(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.entries[0].update(specialization_data="[" * 100_000 + "]" * 100_000))), "levels deep"


@case("deep JSON", "manifest of 5 million tiny values")
def _wide_manifest(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, {**base, "manifest.json": b"[" + b"[]," * 5_000_000 + b"[]]"}), "values"


# -- 7. messages: damaged archives ----------------------------------------------------------------


def _targz(base: Members, tmp: Path) -> bytes:
    return write_tar(tmp / "good.tar.gz", base, gz=True).read_bytes()


@case("damaged archives", "corrupt .tar.gz stream")
def _corrupt_gz(base: Members, tmp: Path) -> tuple[Path, str]:
    data = bytearray(_targz(base, tmp))
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0x5A
    (tmp / "good.tar.gz").unlink()
    (tmp / "hostile.tar.gz").write_bytes(bytes(data))
    return tmp / "hostile.tar.gz", "not a readable tar.gz"


@case("damaged archives", "truncated .tar.gz")
def _cut_gz(base: Members, tmp: Path) -> tuple[Path, str]:
    data = _targz(base, tmp)
    (tmp / "good.tar.gz").unlink()
    (tmp / "hostile.tar.gz").write_bytes(data[: len(data) * 2 // 3])
    return tmp / "hostile.tar.gz", "not a readable tar.gz"


@case("damaged archives", ".tar.gz with a wrong CRC in its gzip trailer")
def _gz_crc(base: Members, tmp: Path) -> tuple[Path, str]:
    data = bytearray(_targz(base, tmp))
    data[-8] ^= 0xFF  # the CRC-32 of the uncompressed tar: the data itself decompresses fine
    (tmp / "good.tar.gz").unlink()
    (tmp / "hostile.tar.gz").write_bytes(bytes(data))
    return tmp / "hostile.tar.gz", "not a readable tar.gz"


@case("damaged archives", "gzip garbage")
def _gz_garbage(base: Members, tmp: Path) -> tuple[Path, str]:
    (tmp / "hostile.tar.gz").write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(4096))
    return tmp / "hostile.tar.gz", "not a readable tar.gz"


@case("damaged archives", "random bytes named .tar")
def _tar_garbage(base: Members, tmp: Path) -> tuple[Path, str]:
    (tmp / "hostile.tar").write_bytes(b"\x00garbage" + os.urandom(4096))
    return tmp / "hostile.tar", "not a readable tar"


@case("damaged archives", "tar with a damaged header after the first member")
def _tar_mid(base: Members, tmp: Path) -> tuple[Path, str]:
    data = bytearray(_tar(tmp, base).read_bytes())
    second = 512 + ((len(base[next(iter(base))]) + 511) // 512) * 512
    data[second : second + 100] = os.urandom(100)
    (tmp / "hostile.tar").write_bytes(bytes(data))
    return tmp / "hostile.tar", "not a readable tar"


@case("damaged archives", "tar cut at a member boundary")
def _tar_boundary(base: Members, tmp: Path) -> tuple[Path, str]:
    data = _tar(tmp, base).read_bytes()
    first = 512 + ((len(base[next(iter(base))]) + 511) // 512) * 512
    (tmp / "hostile.tar").write_bytes(data[:first])
    return tmp / "hostile.tar", "not a readable tar"


@case("damaged archives", "truncated .zip")
def _zip_cut(base: Members, tmp: Path) -> tuple[Path, str]:
    data = write_zip(tmp / "hostile.zip", base).read_bytes()
    (tmp / "hostile.zip").write_bytes(data[: len(data) // 2])
    return tmp / "hostile.zip", "not a readable zip"


@case("damaged archives", "empty file")
def _empty(base: Members, tmp: Path) -> tuple[Path, str]:
    (tmp / "hostile.tar").write_bytes(b"")
    return tmp / "hostile.tar", "not a readable tar"


# -- 8. resources ---------------------------------------------------------------------------------


@case("resources", "manifest of 50,000 entries")
def _many_entries(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.body.update(entries=p.entries * 16_667))), "more than the"


@case("resources", "manifest of 50,000 small entries")
def _many_small_entries(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, edited(base, lambda p: p.body.update(entries=[{"kernel": "k"}] * 50_000))), "50000 entries, more than the 10000"


@case("resources", "manifest over 32 MiB")
def _big_manifest(base: Members, tmp: Path) -> tuple[Path, str]:
    return _tar(tmp, {**base, "manifest.json": b" " * (33 << 20)}), "more than the"


@case("resources", "files declared over 2 GiB in all")
def _big_total(base: Members, tmp: Path) -> tuple[Path, str]:
    def grow(p: Pack) -> None:
        big = [dict(e, binary_hash=f"{i:064x}", files=[dict(f, size=200 << 20) for f in e["files"]]) for i, e in enumerate(p.entries * 4)]
        p.body.update(entries=big)

    return _tar(tmp, edited(base, grow)), "more than the"


@case("resources", "30,000 archive members")
def _many_members(base: Members, tmp: Path) -> tuple[Path, str]:
    def many(tar: tarfile.TarFile) -> None:
        for i in range(30_000):
            info = tarfile.TarInfo(f"files/{i:016x}/x.cubin")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))

    return _tar(tmp, base, extra=many), "members"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("command", ["verify", "install"])
def test_hostile_pack(name: str, command: str, base: Members, tmp_path: Path, triton_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """a hostile pack is answered with exit 2 and one line naming the problem; nothing is written"""
    (tmp_path / "outside").mkdir()
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "hostile_probe.py").write_text(f"open({str(tmp_path / 'outside' / 'imported')!r}, 'w').write('x')\nf = None\n")
    monkeypatch.syspath_prepend(str(probe))
    path, needle = CASES[name](base, tmp_path)
    before = files_under(tmp_path)
    outcome = run_cli(capsys, "pack", command, str(path))
    assert_refused(outcome, needle)
    assert_nothing_written(tmp_path, before, triton_cache)
    assert "hostile_probe" not in sys.modules


def test_one_bad_entry_among_good_ones_is_summarized(base: Members, tmp_path: Path, triton_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """900 entries refused for one reason among 3 good ones: the reason is printed once, with its count; the rest installs"""

    def add_strangers(p: Pack) -> None:
        for i in range(900):
            entry = dict(p.entries[i % 3], jit_name="gone.f", binary_hash=f"{i:064x}")
            for f in entry["files"]:
                p.members[f"files/{entry['binary_hash']}/{f['name']}"] = p.members[f"files/{p.entries[i % 3]['binary_hash']}/{f['name']}"]
            p.entries.append(entry)

    pack = write_tar(tmp_path / "mixed.tar", edited(base, add_strangers))
    outcome = run_cli(capsys, "pack", "install", str(pack))
    assert outcome.code == 1 and "3 installed" in outcome.text and "900 refused" in outcome.text, outcome.text
    refusals = [line for line in outcome.text.splitlines() if line.startswith("refused")]
    assert len(refusals) == 1 and "900 entries" in refusals[0] and "gone.f" in refusals[0]


def test_unlisted_members_are_never_read(base: Members, tmp_path: Path) -> None:
    """four unlisted 40 MiB members: verify and install never hold them in memory (a .tar.gz that
    large is read as a stream, not decompressed into memory)"""
    import tracemalloc

    big = {f"files/{i:016x}/big.cubin": b"\0" * (40 << 20) for i in range(4)}
    tar, gz, zf = (write_tar(tmp_path / "big.tar", {**base, **big}), write_tar(tmp_path / "big.tar.gz", {**base, **big}, gz=True), write_zip(tmp_path / "big.zip", {**base, **big}))
    for path in (tar, gz, zf):
        tracemalloc.start()
        packs.verify(path)
        packs.install(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 30 << 20, f"{path.name}: peak {peak >> 20} MiB"


def test_sigkilled_install_leaves_no_temporary_files_after_a_rerun(base: Members, tmp_path: Path, triton_cache: Path) -> None:
    """temporary files of an install that died (their process is gone) are removed by the next install; a live writer's are kept"""
    import subprocess

    from warmreg.stages import pack_install as _pack_install

    pack = write_dir(tmp_path / "pack", base)
    packs.install(pack)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    planted = []
    for group in triton_cache.rglob("__grp__*.json"):
        group.unlink()  # the entry must be written again
        planted.append(group.parent / f"_scale_kernel.cubin.tmp.{_pack_install._HOST}-{dead}.abc")
        planted.append(group.parent / f"_scale_kernel.cubin.tmp.{_pack_install._HOST}-{os.getpid()}.live")
    for p in planted:
        p.write_bytes(b"half")
    report = packs.install(pack)
    assert report.installed == 3
    assert [p.exists() for p in planted] == [False, True] * 3


def test_a_pack_naming_only_functions_no_plugin_package_holds_is_refused_without_loading_plugins(
    base: Members, tmp_path: Path, triton_cache: Path
) -> None:
    """a pack naming only functions of packages no plugin provides: refused before the plugins (and torch) load

    From the shell, loading the plugins means importing torch (2 s and more on the 2-core machine);
    the answer is the same as after loading them."""
    import subprocess

    from tests.test_warm_imports import _NO_TORCH

    hostile = _tar(tmp_path, edited(base, _every_entry(lambda p, e: e.update(jit_name="this.f"))))
    for command in ("verify", "install"):
        done = subprocess.run([sys.executable, "-c", _NO_TORCH, "pack", command, str(hostile)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "TRITON_CACHE_DIR": str(triton_cache)})  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "'this.f'" in lines[0] and "never imports" in lines[0], done.stderr[-2000:]
    assert files_under(triton_cache) == set()


@pytest.mark.parametrize("bound", [1 << 30, 0], ids=["in memory", "as a stream"])
def test_a_tar_gz_installs_the_same_decompressed_in_memory_or_read_as_a_stream(
    bound: int, base: Members, tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a .tar.gz pack is read in memory up to the bound and as a stream beyond it: the same manifest and files"""
    from warmreg.stages import pack_reader as _pack_reader

    monkeypatch.setattr(_pack_reader, "IN_MEMORY", bound)
    path = write_tar(tmp_path / "good.tar.gz", base, gz=True)
    reader = _pack_reader.Reader(path)
    try:
        assert isinstance(reader._tar.fileobj, io.BytesIO) is (bound > 0)  # type: ignore[union-attr]
        assert reader.read(dict.fromkeys(base)) == base
    finally:
        reader.close()
    report = packs.install(path)
    assert report.installed == len(packs.inspect_pack(path).entries) and not report.refused
