"""Record what warmreg reads of the real engine config objects, for the unit tests without engines.

Run in an engine's venv (``bash scripts/engine-envs.sh record``), from a folder with no ``warmreg/``
in it:  python scripts/record_engine_snapshots.py {vllm|sglang} OUTDIR

For each case of ``tests/engines/cases.py`` it builds the real object and writes
``OUTDIR/<engine>-<case>.json``: the engine's version, the attributes :mod:`warmreg.engines` reads
(vLLM: at ``VLLM_PATHS``; SGLang: the resolved ``SGLANG_FIELDS`` and the ModelConfig's
``context_len``/``dtype``), and the hf_config's class and ``to_dict()``. An enum member is written as
``{"__enum__": class, "name", "value"}``, a torch dtype as ``{"__dtype__": name}``.
``tests/test_engine_configs.py`` turns a file back into plain objects of the recorded attributes.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "engines"))

import cases  # noqa: E402

from warmreg import engines  # noqa: E402


def plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return {"__enum__": type(value).__name__, "name": value.name, "value": plain(value.value)}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).rsplit(".", 1)[-1]}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def hf(config: Any) -> dict[str, Any]:
    return {"__class__": f"{type(config).__module__}.{type(config).__qualname__}", "to_dict": plain(config.to_dict())}


def record_vllm(case: str, root: Path) -> dict[str, Any]:
    vc = cases.build_vllm(case, root)
    attrs = {path: plain(engines.dotted(vc, path)) for path in engines.VLLM_PATHS.values()}
    return {"type": type(vc).__name__, "attributes": attrs, "hf_config_at": "model_config.hf_config",
            "hf_config": hf(vc.model_config.hf_config)}  # fmt: skip


def record_sglang(case: str, root: Path) -> dict[str, Any]:
    from sglang.srt.arg_groups.model_override_base import model_config_of

    sa = cases.build_sglang(case, root)
    sa.resolve_once()
    resolved = sa.resolved_dict()
    mc = model_config_of(sa)
    attrs = {name: plain(resolved.get(name)) for name in engines.SGLANG_FIELDS}
    attrs.update({"model_config.context_len": plain(mc.context_len), "model_config.dtype": plain(mc.dtype)})
    return {"type": type(sa).__name__, "attributes": attrs, "hf_config_at": "hf_config", "hf_config": hf(mc.hf_config),
            "note": "resolved values (ServerArgs.resolved_dict()), as warmreg reads a resolved ServerArgs"}  # fmt: skip


def main() -> int:
    engine, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    record = {"vllm": record_vllm, "sglang": record_sglang}[engine]
    case_names = {"vllm": cases.VLLM_CASES, "sglang": cases.SGLANG_CASES}[engine]
    root = cases.scratch()
    for case in case_names:
        snap = {"engine": engine, "version": importlib.metadata.version(engine), "case": case, **record(case, root)}
        # the scratch folder's path is not part of the deployment
        text = json.dumps(snap, indent=1, sort_keys=True).replace(str(root), "<model-dir>")
        (out / f"{engine}-{case}.json").write_text(text + "\n")
        print(f"recorded {engine} {case}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
