"""The check both vLLM pack tests run in a fresh process (``python -c CHECK <vllm serve arguments>``): vLLM's own
``compile(key)`` of every Triton key of the deployment under the H200 profile's target, counting Triton's compiles and
cache hits with its compilation listener; prints one JSON line (keys per kernel, failed keys, compiled, hits)."""

CHECK = """
    import json, sys, triton
    from warmreg import Platform, cross_target
    from warmreg_vllm.cli import _engine_args
    from warmreg_vllm.profile import GpuProfile
    from warmreg_vllm.vllm_pack import compile_keys, deployment

    h200, seen = GpuProfile.named("h200"), {"compiled": [], "hits": 0}

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            seen["hits"] += 1
        else:
            seen["compiled"].append(metadata_group and sorted(metadata_group)[0])

    triton.knobs.compilation.listener = listener
    with deployment(_engine_args(sys.argv[1:]), h200) as (vllm_config, found):
        kernels = [k for k in found.kernels if k.kind == "triton"]
        with cross_target(Platform.parse(h200.triton_target.target)):
            failed = compile_keys(kernels, workers=2)
    print(json.dumps({"keys": {k.name: len(k.keys) for k in kernels}, "failed": failed, **seen}))
"""
