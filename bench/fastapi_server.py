#!/usr/bin/python3
"""fastapi_server.py - the FastAPI baseline for bench/run.sh.

Serves one TorchScript model the way a small FastAPI + uvicorn service
usually does: one uvicorn worker process, torch.set_num_threads(1), the
model loaded once with torch.jit.load.

    POST /predict   body {"instances": rows} or a bare list of rows
                    -> {"predictions": [[...], ...]}
    POST /predict_f the same for rows already scaled to [0, 1] (what
                    json.dumps(x.tolist()) of a ToTensor() image sends)

/predict multiplies the input by --scale (1/255 by default, like
examples/fashion_mnist/model.json's preprocess.scale) before forward.

    /usr/bin/python3 bench/fastapi_server.py --port 8000 \
        --model examples/fashion_mnist/model.pt

The handler is `async def` and runs forward inline on the event loop, and it
answers a JSONResponse directly (skipping FastAPI's jsonable_encoder): the
fastest plain FastAPI shape for a CPU-bound model in one process, so the
baseline is not a strawman. GET /healthz answers {"status": "ok"}.
"""
import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, HTTPException, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402


def build_app(model_path: str, scale: float) -> FastAPI:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    model = torch.jit.load(model_path, map_location="cpu")
    model.eval()
    app = FastAPI()

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/predict")
    async def predict(request: Request):
        return await run(request, scale)

    @app.post("/predict_f")
    async def predict_f(request: Request):
        return await run(request, 1.0)

    async def run(request: Request, scale: float):
        try:
            body = await request.json()
        except ValueError as e:
            raise HTTPException(status_code=400, detail=f"invalid JSON: {e}")
        rows = body.get("instances") if isinstance(body, dict) else body
        if not isinstance(rows, list) or not rows:
            raise HTTPException(status_code=400,
                                detail='send {"instances": rows} or a list of rows')
        try:
            x = torch.tensor(rows, dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise HTTPException(status_code=400, detail=f"bad rows: {e}")
        try:
            with torch.inference_mode():
                y = model(x * scale)
        except RuntimeError as e:  # wrong row length and the like
            raise HTTPException(status_code=400, detail=str(e).splitlines()[-1])
        return JSONResponse({"predictions": y.tolist()})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="examples/fashion_mnist/model.pt")
    ap.add_argument("--scale", type=float, default=1.0 / 255.0)
    args = ap.parse_args()
    app = build_app(args.model, args.scale)
    uvicorn.run(app, host=args.host, port=args.port, workers=1,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
