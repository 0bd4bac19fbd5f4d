"""Prefetch: the part of a warm that depends on no config, started early on background threads."""

from __future__ import annotations

import logging
import os
import threading

from .. import _triton
from .._triton import cache as _triton_cache
from ..stages import remember
from ..stages.pack import prefetch_install

__all__ = ["prefetch", "wait_for_plugins", "wait_for_prefetch"]

log = logging.getLogger("warmreg.api.prefetch")


def prefetch(pack: str | os.PathLike[str] | None = None) -> None:
    """Start, on background threads, the part of a warm that depends on no config: Triton's hash of
    its own installation (``triton_key()``, which reads the 415 MB ``libtriton.so``: ~0.5 s on the
    H200 host, the largest single cost of a warm from a warm cache or a pack), importing the
    installed plugins with their kernels (~0.4 s there: the first plan's cost), then the modules
    Triton imports at its first specialization and each kernel's source hash, and the CUDA driver's
    utility module Triton compiles into a fresh cache (0.4-0.9 s of a warm from a pack there). Then,
    until a warm starts binding, Triton's binder of each plugin function for the local GPUs' target
    (what a function's first launch on a device makes: 0.3-0.7 ms each on the CPU machine, 21 of them
    in the DeepSeek-V4-Flash example), the target read without starting CUDA (NVML, or Triton's driver
    where torch has started CUDA already), and the specializations the last warms into this cache kept
    (:mod:`warmreg.stages.remember`), decoded and hashed as a prefetched pack's are.

    :param pack: a pack the engine will warm with: installed too, once the plugins are imported,
        into the cache directory ``TRITON_CACHE_DIR`` names now, for the pack's own target (read,
        verified and written as :func:`warmreg.stages.pack.install` does). A warm of that pack into that
        cache then waits for it instead of installing; it installs the pack itself if the
        prefetch failed, refused an entry, or installed it for another target or cache directory.
        Meanwhile it also makes Triton's binder of each of the pack's functions for the pack's target (what
        a function's first launch on a device makes), which the warm's binding takes on a GPU of that target.

    Call it early in an engine's start-up (before loading weights); :func:`warm` starts it too if it
    has not started, and waits for each part only where it needs it. Idempotent; returns at once.
    """
    global _plugins_thread
    _triton_cache.prefetch_triton_key()
    with _plugins_lock:
        if _plugins_thread is None:
            _plugins_thread = threading.Thread(target=_import_plugins, name="warmreg-plugins", daemon=True)
            _plugins_thread.start()
    if pack is not None:
        prefetch_install(pack, after=_plugins_imported)


_plugins_lock = threading.Lock()
_plugins_thread: threading.Thread | None = None
_plugins_imported = threading.Event()  # set when the plugins thread has imported and hashed (the binders come after)


def wait_for_plugins() -> None:
    """Start :func:`prefetch` if the engine did not, and wait for its import of the plugins (not for the binders
    it makes after: a warm that starts binding stops them)."""
    prefetch()
    _plugins_imported.wait()  # one import of the plugins, not two racing


def wait_for_prefetch() -> None:
    """Wait for every part of :func:`prefetch` started so far: Triton's hash of its installation, the plugins, the
    binders for the local GPUs and the packs being installed; what an engine's weight loading gives the prefetch
    time for (the benchmarks wait for it before their timer starts). Errors are not raised here: the warm meets
    them again and reports them."""
    from ..stages.pack import prefetched

    _triton_cache.wait_triton_key()
    wait_for_plugins()
    assert _plugins_thread is not None
    _plugins_thread.join()
    for pending in prefetched():
        pending.exception()


def _import_plugins() -> None:
    from ..stages.pack import loaded_jits

    try:
        jits = loaded_jits()  # the installed plugins imported, and their kernels' jit functions
    except Exception as exc:  # the warm's own plan loads them again and reports the problem
        log.debug("prefetch could not import the plugins: %r", exc)
        _plugins_imported.set()
        return
    try:
        # what the first warm of a process computes once, whatever the config: the warm's own modules
        # (imported at its first call otherwise), the modules Triton imports at its first specialization,
        # and each kernel's source hash (an AST walk of its callees)
        from ..pipeline import run  # noqa: F401
        from ..stages import compose  # noqa: F401
        from . import session  # noqa: F401

        _triton.preimport()
        for jit in jits.values():
            try:
                _triton.source_hash(jit)
            except Exception as exc:  # the warm computes it again and reports the kernel that fails
                log.debug("prefetch could not hash %s: %r", _triton.full_name(jit), exc)
    finally:
        _plugins_imported.set()
    try:
        targets = _triton.local_targets()
        for target in targets:
            _triton.prepare_binders(jits.values(), target, until_binding=True)
        if targets:  # what the last warms of this cache specialized, for these GPUs
            remember.decode(jits, targets, stop=_triton.binding_started)
    except Exception as exc:  # only a head start: binding makes and specializes what is missing, as Triton does
        log.debug("prefetch made no binders or specializations for the local GPUs: %r", exc)
