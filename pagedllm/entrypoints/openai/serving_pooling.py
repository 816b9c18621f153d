"""The pooling endpoints: ``POST /v1/embeddings`` (OpenAI), ``/pooling`` (vLLM),
``/score`` + ``/v1/score`` (vLLM) and ``/rerank`` + ``/v1/rerank`` + ``/v2/rerank``
(vLLM's and Cohere's shapes).

Every prompt of a body becomes one engine request (``AsyncLLM.add_request`` with
``PoolingParams``: whole prompt, one step, no KV cache); the response waits for all of
them.  A model that does not serve the task answers 400 naming its task(s); bad input
400 naming the field.  Scores come from a cross-encoder reading each pair together, or,
for an embedding model, the cosine of the two embeddings (as vLLM).
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.llm_pooling import pair_up
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.serving_base import (
    ServingHandler,
    engine_error_response,
    with_cancellation,
)
from pagedllm.pooling_params import PoolingParams


class OpenAIServingPooling(ServingHandler):
    def tasks(self) -> tuple[str, ...]:
        pc = self.state.engine.config.model_config.pooler_config
        return ("generate",) if pc is None else pc.tasks

    def refuse_generation(self) -> Response | None:
        """A 400 naming the model and its task when it is a pooling model (for the
        completion and chat endpoints); None for a generative model."""
        tasks = self.tasks()
        if "generate" in tasks:
            return None
        return engine_error_response(RequestError(
            f"model: `{self.state.model_name}` is a pooling model (task: "
            f"{', '.join(tasks)}); it does not generate -- use /v1/embeddings, /score or "
            "/rerank", "model"))

    def _need(self, wanted: tuple[str, ...], what: str) -> str:
        """The first of ``wanted`` the model serves; 400 naming the model's tasks."""
        tasks = self.tasks()
        for t in wanted:
            if t in tasks:
                return t
        name = self.state.model_name
        raise RequestError(
            f"model: `{name}` does not support {what}: its task is {', '.join(tasks)}"
            + (" (a generative model; serve an embedding model, or this one with "
               "--runner pooling)" if tasks == ("generate",) else ""), "model")

    async def _run(self, raw_request: Request, prefix: str, body: Any, prompts: list[Any],
                   params: PoolingParams) -> tuple[str, list[Any]]:
        """Start one engine request per prompt and wait for all (in order)."""
        st = self.state
        st.check_admitting()
        public_id = st.public_id(raw_request, prefix, body.request_id)
        streams = await st.start(public_id, prompts, params, body.priority,
                                 add_special_tokens=getattr(body, "add_special_tokens",
                                                            True))
        try:
            outs = []
            for s in streams:
                last = None
                async for out in s:
                    last = out
                outs.append(last)
            return public_id, outs
        finally:
            st.finish(public_id, streams)

    # -- /v1/embeddings and /pooling ----------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, raw_request: Request,
                         pooling: bool = False) -> Response:
        st = self.state
        try:
            st.check_unknown(body)
            st.check_model(body.model)
            task = self._need(("encode",) if pooling else ("embed",),
                              "pooling" if pooling else "embeddings")
            prompts = body.prompts()
            st.check_num_inputs(len(prompts), "input")
            params = PoolingParams(task=task, normalize=body.normalize,
                                   dimensions=body.dimensions)
        except Exception as e:
            return engine_error_response(e)

        async def run() -> Response:
            try:
                pid, outs = await self._run(raw_request, "pool" if pooling else "embd",
                                            body, prompts, params)
            except Exception as e:
                return engine_error_response(e)
            data = [{"index": i, "object": "pooling" if pooling else "embedding",
                     ("data" if pooling else "embedding"):
                     _encode(o.outputs.data, body.encoding_format)}
                    for i, o in enumerate(outs)]
            n = sum(len(o.prompt_token_ids) for o in outs)
            return JSONResponse({"id": pid, "object": "list", "created": int(time.time()),
                                 "model": body.model or st.model_name, "data": data,
                                 "usage": {"prompt_tokens": n, "total_tokens": n}})

        return await with_cancellation(raw_request, run)

    # -- scores ---------------------------------------------------------------------------
    async def _scores(self, raw_request: Request, body: Any, pairs: list[tuple[str, str]],
                      ) -> tuple[str, list[float], int]:
        """Scores of ``pairs`` and the prompt tokens they took."""
        task = self._need(("score", "embed"), "scoring")
        ip = self.state.engine.input_processor
        if task == "score":
            prompts = []
            for a, b in pairs:
                ids, types = await self.state.off_loop(ip.tokenize_pair, a, b)
                prompts.append({"prompt_token_ids": ids, "token_type_ids": types})
            pid, outs = await self._run(raw_request, "score", body, prompts,
                                        PoolingParams(task="score"))
            return pid, [o.outputs.data[-1] for o in outs], \
                sum(len(o.prompt_token_ids) for o in outs)
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        texts = firsts + [b for _, b in pairs]
        pid, outs = await self._run(raw_request, "score", body, texts,
                                    PoolingParams(task="embed", normalize=True))
        emb = np.asarray([o.outputs.data for o in outs], dtype=np.float64)
        first = {t: emb[i] for i, t in enumerate(firsts)}
        scores = [float(first[a] @ emb[len(firsts) + j]) for j, (a, _) in enumerate(pairs)]
        return pid, scores, sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, body: ScoreRequest, raw_request: Request) -> Response:
        st = self.state
        try:
            st.check_unknown(body)
            st.check_model(body.model)
            pairs = pair_up(body.text_1, body.text_2)
            st.check_num_inputs(len(pairs), "text_2")
        except Exception as e:
            return engine_error_response(e)

        async def run() -> Response:
            try:
                pid, scores, n = await self._scores(raw_request, body, pairs)
            except Exception as e:
                return engine_error_response(e)
            return JSONResponse({
                "id": pid, "object": "list", "created": int(time.time()),
                "model": body.model or st.model_name,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": n, "total_tokens": n}})

        return await with_cancellation(raw_request, run)

    async def rerank(self, body: RerankRequest, raw_request: Request) -> Response:
        st = self.state
        try:
            st.check_unknown(body)
            st.check_model(body.model)
            docs = body.texts()
            st.check_num_inputs(len(docs), "documents")
        except Exception as e:
            return engine_error_response(e)

        async def run() -> Response:
            try:
                pid, scores, n = await self._scores(
                    raw_request, body, [(body.query, d) for d in docs])
            except Exception as e:
                return engine_error_response(e)
            order = sorted(range(len(docs)), key=lambda i: -scores[i])
            if body.top_n:
                order = order[:body.top_n]
            results: list[dict[str, Any]] = []
            for i in order:
                r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
                if body.return_documents:
                    r["document"] = {"text": docs[i]}
                results.append(r)
            return JSONResponse({
                "id": pid, "model": body.model or st.model_name, "results": results,
                "usage": {"prompt_tokens": n, "total_tokens": n},
                # Cohere's envelope.
                "meta": {"api_version": {"version": "2"},
                         "billed_units": {"search_units": 1}}})

        return await with_cancellation(raw_request, run)


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    """OpenAI's ``encoding_format``: floats, or base64 of little-endian float32."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


def add_pooling_routes(app: FastAPI, handler: OpenAIServingPooling) -> None:
    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await handler.embeddings(body, raw_request)

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw_request: Request) -> Response:
        return await handler.embeddings(body, raw_request, pooling=True)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, handler.score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, handler.rerank, methods=["POST"])


