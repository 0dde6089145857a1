#!/usr/bin/env python3
"""Calls tokenmesh's OpenAI-compatible API with real clients: the official
`openai` library and LangChain's `ChatOpenAI` (tests/tests/openai.rs runs it).

Every command prints JSON lines; the last line is the result. With
--print-chunks each streamed content chunk is also printed (and flushed) as
it arrives, so a test can act mid-stream (kill the worker serving it).
An error the library raises is a result too: {"error": class name, ...}.
"""
import argparse
import json
import ssl
import sys


def emit(obj):
    print(json.dumps(obj), flush=True)


def http_client(args):
    import httpx

    if not args.ca:
        return httpx.Client(timeout=120)
    ctx = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        ctx.load_cert_chain(args.cert, args.key)
    return httpx.Client(verify=ctx, timeout=120)


def openai_client(args):
    import openai

    return openai.OpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        http_client=http_client(args),
        max_retries=0,
    )


def sampling(args):
    kw = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    if args.seed is not None:
        kw["seed"] = args.seed
    if args.ignore_eos:
        # vLLM's extension, which the library passes through as it is.
        kw["extra_body"] = {"ignore_eos": True}
    return kw


def headers_of(raw):
    return {
        "version": raw.headers.get("x-tokenmesh-version"),
        "worker": raw.headers.get("x-tokenmesh-worker"),
        "request_id": raw.headers.get("x-request-id"),
    }


def messages(args):
    return [
        {"role": "system", "content": args.system},
        {"role": "user", "content": args.prompt},
    ]


def chat(args):
    c = openai_client(args)
    extra = {"extra_headers": {"x-session-id": args.session}} if args.session else {}
    if not args.stream:
        raw = c.chat.completions.with_raw_response.create(
            model=args.model, messages=messages(args), **sampling(args), **extra
        )
        r = raw.parse()
        return {
            **headers_of(raw),
            "object": r.object,
            "id": r.id,
            "model": r.model,
            "system_fingerprint": r.system_fingerprint,
            "text": r.choices[0].message.content,
            "role": r.choices[0].message.role,
            "finish_reason": r.choices[0].finish_reason,
            "usage": r.usage.model_dump() if r.usage else None,
        }
    opts = {"stream_options": {"include_usage": True}} if args.include_usage else {}
    raw = c.chat.completions.with_raw_response.create(
        model=args.model, messages=messages(args), stream=True, **sampling(args), **opts, **extra
    )
    out = {**headers_of(raw), "text": "", "chunks": 0, "usage": None, "finish_reason": None}
    if args.print_chunks:
        emit({"headers": headers_of(raw)})
    for chunk in raw.parse():
        out["chunks"] += 1
        out["object"] = chunk.object
        if chunk.usage:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.role:
                out["role"] = choice.delta.role
            if choice.delta.content:
                out["text"] += choice.delta.content
                if args.print_chunks:
                    emit({"chunk": choice.delta.content})
            if choice.finish_reason:
                out["finish_reason"] = choice.finish_reason
    return out


def completion(args):
    c = openai_client(args)
    if not args.stream:
        raw = c.completions.with_raw_response.create(
            model=args.model, prompt=args.prompt, **sampling(args)
        )
        r = raw.parse()
        return {
            **headers_of(raw),
            "object": r.object,
            "id": r.id,
            "text": r.choices[0].text,
            "finish_reason": r.choices[0].finish_reason,
            "usage": r.usage.model_dump() if r.usage else None,
        }
    opts = {"stream_options": {"include_usage": True}} if args.include_usage else {}
    raw = c.completions.with_raw_response.create(
        model=args.model, prompt=args.prompt, stream=True, **sampling(args), **opts
    )
    out = {**headers_of(raw), "text": "", "chunks": 0, "usage": None, "finish_reason": None}
    for chunk in raw.parse():
        out["chunks"] += 1
        out["object"] = chunk.object
        if chunk.usage:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            out["text"] += choice.text or ""
            if choice.finish_reason:
                out["finish_reason"] = choice.finish_reason
    return out


def models(args):
    c = openai_client(args)
    return {"ids": [m.id for m in c.models.list()]}


def versions(args):
    """--count chat requests; how many each version served (header)."""
    c = openai_client(args)
    seen = {}
    extra = {"extra_headers": {"x-session-id": args.session}} if args.session else {}
    for _ in range(args.count):
        raw = c.chat.completions.with_raw_response.create(
            model=args.model, messages=messages(args), **sampling(args), **extra
        )
        r = raw.parse()
        v = raw.headers.get("x-tokenmesh-version")
        assert r.system_fingerprint == v, (r.system_fingerprint, v)
        seen[v] = seen.get(v, 0) + 1
    return {"versions": seen}


def langchain(args):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        temperature=args.temperature if args.temperature is not None else 0,
        max_tokens=args.max_tokens,
        max_retries=0,
        streaming=True,
        http_client=http_client(args),
    )
    chunks = []
    usage = None
    for chunk in llm.stream([("system", args.system), ("human", args.prompt)]):
        if chunk.content:
            chunks.append(chunk.content)
        if getattr(chunk, "usage_metadata", None):
            usage = dict(chunk.usage_metadata)
    return {"text": "".join(chunks), "chunks": len(chunks), "usage": usage}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["chat", "completion", "models", "versions", "langchain"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="unused")
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--system", default="You are a helpful assistant.")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--include-usage", action="store_true")
    p.add_argument("--print-chunks", action="store_true")
    p.add_argument("--session")
    p.add_argument("--count", type=int, default=1)
    args = p.parse_args()

    import openai

    command = globals()[args.command]
    try:
        emit(command(args))
    except openai.APIStatusError as e:
        emit({"error": type(e).__name__, "status": e.status_code, "body": e.body,
              "retry_after": e.response.headers.get("retry-after")})
    except openai.APIError as e:
        emit({"error": type(e).__name__, "message": e.message, "body": e.body})


if __name__ == "__main__":
    sys.exit(main())
