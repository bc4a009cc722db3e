"""Patch of ``vllm.v1.engine.core_client.MPClient``: no false "engine core exited unexpectedly"
at a clean interpreter exit.

Upstream limitation (vLLM 0.32): at interpreter exit, weakref finalizers run newest first. An
MPClient makes its finalizer, then starts the engine-core processes, whose manager makes one
too; so at exit the manager's runs first and terminates the engine core while the client is
still alive, and the client's liveness monitor logs "[shutdown] MPClient: engine core exited
unexpectedly; starting cleanup" after every script that leaves its LLM to the interpreter's
exit. On any device.

How: once a client is built, its finalizer is made anew, so that it is the newer one and runs
first; it marks the engine as shut down before it stops the engine manager, and the monitor
stays quiet. Remove when vLLM orders these finalizers itself.
"""

import weakref

from vllm.v1.engine import core_client

_original_init = core_client.MPClient.__init__


def _init_then_renew_finalizer(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    if self._finalizer.detach() is not None:
        self._finalizer = weakref.finalize(self, self.resources)


def apply() -> None:
    core_client.MPClient.__init__ = _init_then_renew_finalizer
