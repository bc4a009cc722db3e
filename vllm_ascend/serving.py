"""What `vllm serve` adds on Ascend: while sleep mode has the engine asleep, a request that
needs the engine gets an error at once (vLLM would queue it until someone wakes the engine,
which, in an RL loop, may be minutes away, or never for a client that gave up)."""

from fastapi import Request
from fastapi.responses import JSONResponse

MIDDLEWARE = f"{__name__}.refuse_requests_while_asleep"


async def refuse_requests_while_asleep(request: Request, call_next):
    """An ASGI middleware (vLLM's --middleware, which the platform sets by default): POSTs to
    the OpenAI endpoints (/v1/...) of a server started with --enable-sleep-mode get 503 while
    the engine sleeps."""
    args = getattr(request.app.state, "args", None)
    if request.method == "POST" and request.url.path.startswith("/v1/") and \
            getattr(args, "enable_sleep_mode", False) and \
            await request.app.state.engine_client.is_sleeping():
        return JSONResponse(status_code=503, content={"error": {
            "message": "The engine is asleep (sleep mode): POST /wake_up to wake it (with "
                       "tags=weights then tags=kv_cache, or no tags for both), then retry.",
            "type": "ServiceUnavailableError", "param": None, "code": 503}})
    return await call_next(request)
