"""``pagedllm serve | generate | chat | bench | models``.

Every failure a user can cause (bad flag value, missing model, prompt too long) prints
one line to stderr and exits with status 1; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from pagedllm.entrypoints.engine_cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_args_from_cli,
)

if TYPE_CHECKING:
    from pagedllm.outputs import CompletionOutput


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, except where the help text already says it
    or there is nothing to show (``None``, a switch that is off).  Identity, not
    equality: a default of ``0`` or ``0.0`` (temperature, min-p) equals ``False`` and
    is shown."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or "default" in text.lower() or "%(default)" in text):
            return text
        return super()._get_help_string(action) or text


def _sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _build_engine(args: argparse.Namespace):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.logger import init_logger

    init_logger()
    return LLMEngine.from_engine_args(engine_args_from_cli(args))


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete one prompt (raw text, or as a chat turn with --chat) and print it."""
    params = _sampling_params(args)
    engine = _build_engine(args)
    prompt: object = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": engine.input_processor.apply_chat_template(
            [{"role": "user", "content": args.prompt}])}
    engine.add_request("0", prompt, params)  # type: ignore[arg-type]
    tokenizer = engine.input_processor.tokenizer
    has_template = bool(getattr(tokenizer, "chat_template", None))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                print(out.outputs[0].text)
                for note in finish_notes(out.outputs[0], params.max_tokens, args.chat,
                                         has_template):
                    print(note, file=sys.stderr)
    return 0


def finish_notes(c: CompletionOutput, max_tokens: int | None, chat: bool,
                 has_chat_template: bool) -> list[str]:
    """What ``generate`` says on stderr when its output is empty or cut short: the
    ``finish_reason`` and why, and for a chat model run without ``--chat`` that the chat
    template exists.  Nothing for a complete, non-empty answer."""
    notes = []
    empty = not c.text.strip()
    if c.finish_reason == "length":
        notes.append(length_note(len(c.token_ids), max_tokens))
    elif empty:
        why = (f"it hit the stop string {c.stop_reason!r}" if isinstance(c.stop_reason, str)
               else f"stop token {c.stop_reason}" if c.stop_reason is not None
               else "the model ended its answer at once (end-of-sequence token)")
        notes.append(f"note: the output is empty (finish_reason={c.finish_reason}: {why})")
    if notes and not chat and has_chat_template:
        notes.append("hint: this model has a chat template; --chat sends the prompt as a "
                     "user message, which instruct models answer better")
    return notes


def length_note(num_tokens: int, max_tokens: int | None, what: str = "output") -> str:
    """The note for an answer of ``num_tokens`` that ended with ``finish_reason=length``:
    cut at ``--max-tokens``, or by a full context."""
    if max_tokens is not None and num_tokens >= max_tokens:
        return (f"note: {what} cut at --max-tokens {max_tokens} (finish_reason=length); "
                "raise it for a longer answer")
    return (f"note: {what} cut after {num_tokens} tokens: the context is full "
            "(finish_reason=length; see --max-model-len)")


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat with the model's chat template, streaming tokens as they come."""
    from pagedllm.engine.output_processor import RequestOutputKind

    params = _sampling_params(args)
    engine = _build_engine(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chatting with the model; empty line or Ctrl-D to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        ids = engine.input_processor.apply_chat_template(messages)
        engine.add_request(f"chat-{turn}", {"prompt_token_ids": ids}, params,
                           kind=RequestOutputKind.DELTA)
        turn += 1
        reply = []
        num_tokens, finish = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].text
                num_tokens += len(out.outputs[0].token_ids)
                finish = out.outputs[0].finish_reason or finish
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if finish == "length":  # say so: the reply is not the model's whole answer
            print(length_note(num_tokens, params.max_tokens, "reply"), file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="Complete a prompt and print the result.",
                       description=cmd_generate.__doc__, formatter_class=HelpFormatter)
    p.add_argument("prompt", help="The prompt text.")
    p.add_argument("--chat", action="store_true",
                   help="Wrap the prompt as a user message with the chat template.")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="Interactive chat in the terminal.",
                       description=cmd_chat.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--system", default=None, help="An optional system message.")
    add_sampling_args(p)
    p.set_defaults(max_tokens=512)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)


def _add_serve(sub) -> None:
    try:
        from pagedllm.entrypoints.openai import api_server, cli_args
    except ImportError as e:
        # Keep the command, so that `pagedllm serve` says what is missing instead of
        # argparse's "invalid choice: 'serve'".
        missing = e.name or str(e)
        p = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server "
                           f"(unavailable here: cannot import {missing}).",
                           add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")  # every flag is a plain word here
        p.set_defaults(func=lambda _args: _serve_unavailable(missing))
        return
    p = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server.",
                       formatter_class=HelpFormatter)
    # vLLM's positional form, `pagedllm serve MODEL`, besides --model.
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="The model to serve (same as --model).")
    cli_args.add_serve_args(p)
    p.set_defaults(func=partial(_serve, api_server.run_server))


def _serve(run_server: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    merge_model_tag(args)
    return int(run_server(args) or 0)


def merge_model_tag(args: argparse.Namespace) -> None:
    """``serve MODEL`` sets ``--model``; both, naming different models, is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"model: given twice, as MODEL ({tag!r}) and --model "
                         f"({args.model!r}); give one")
    args.model = tag


def _serve_unavailable(missing: str) -> int:
    # Often a dependency of a dependency (fastapi 0.165 imports opentelemetry), so name
    # the module that failed rather than guess the package.
    print(f"error: pagedllm serve is unavailable: its server stack cannot import module "
          f"{missing!r}; install it (or reinstall pagedllm's dependencies)", file=sys.stderr)
    return 1


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="Benchmarks (throughput, latency, spec, serve, soak, "
                       "structured, perplexity, parallel, embed, multiturn, matrix).",
                       formatter_class=HelpFormatter)
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    for name, module in (("throughput", "pagedllm.benchmarks.throughput"),
                         ("latency", "pagedllm.benchmarks.latency"),
                         ("spec", "pagedllm.benchmarks.spec_concurrency"),
                         ("serve", "pagedllm.benchmarks.serve"),
                         ("soak", "pagedllm.benchmarks.soak"),
                         ("structured", "pagedllm.benchmarks.structured"),
                         ("perplexity", "pagedllm.benchmarks.perplexity"),
                         ("parallel", "pagedllm.benchmarks.parallel"),
                         ("embed", "pagedllm.benchmarks.embed"),
                         ("multiturn", "pagedllm.benchmarks.multiturn"),
                         ("matrix", "pagedllm.benchmarks.matrix")):
        try:
            mod = __import__(module, fromlist=["add_args", "main"])
        except ImportError:
            continue
        bp = bsub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0],
                             formatter_class=HelpFormatter)
        mod.add_args(bp)
        bp.set_defaults(func=mod.main)


def cmd_models(args: argparse.Namespace) -> int:
    """Print every supported architecture with what it supports (docs/models.md)."""
    from pagedllm.models.registry import architectures_table

    print(architectures_table())
    return 0


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="List the supported architectures: tasks, "
                       "quantisation, TP, PP, prefix caching, CUDA graphs, attention.",
                       description=cmd_models.__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=cmd_models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: a paged-KV-cache LLM inference engine.",
        formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    adders: Sequence[Callable] = (_add_serve, _add_generate, _add_chat, _add_bench,
                                  _add_models)
    for add in adders:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
