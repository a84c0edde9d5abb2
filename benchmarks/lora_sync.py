"""LoRA into vLLM: merged weights pushed in place vs vLLM's own LoRA support (an adapter folder).

One mode per process (two in-process vLLM engines do not share a process well):

    .venv/bin/python benchmarks/lora_sync.py --mode merged
    .venv/bin/python benchmarks/lora_sync.py --mode adapter

Both start from the embedded SmolLM2-135M-Instruct with a rank-16 adapter on every projection
whose B matrices are set to small random values (a trained adapter, not the B = 0 start), then
repeat `--syncs` times: perturb the adapter (an "update"), hand it to vLLM, sample 16 prompts x
40 tokens at temperature 1. It prints the seconds per sync and per generation, and the largest
per-token log-prob gap between vLLM's samples and the adapted policy scored by transformers in
float32 (the trainer's `rollout/logprob_gap`): a correct sync keeps it at float32 noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from rlver.modeling.batch import token_logprobs
from rlver.modeling.lora import LoraSettings, add_adapter, inference_state_dict
from rlver.modeling.models import load_policy

PROMPTS = [
    "My sister stopped talking to me after the wedding.",
    "I failed the exam again and my parents do not know yet.",
    "Work has been too much lately, I cannot sleep.",
    "My best friend moved away and I feel alone.",
]


def perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)


def largest_gap(policy, prompt_ids: list[list[int]], generations) -> float:
    gap = 0.0
    with torch.no_grad():
        for prompt, (ids, logprobs) in zip(prompt_ids, generations, strict=True):
            if not ids:
                continue
            full = torch.tensor([prompt + list(ids)])
            ours = token_logprobs(policy.model(full).logits, full)[0, len(prompt) :]
            gap = max(gap, (ours - torch.tensor(logprobs)).abs().max().item())
    return gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("merged", "adapter"), required=True)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    policy = load_policy("smollm2-135m-instruct", dtype="float32")
    policy.model = add_adapter(policy.model, LoraSettings(rank=args.rank, alpha=2.0 * args.rank))
    generator = torch.Generator().manual_seed(0)
    perturb(policy.model, generator)
    policy.model.eval()

    tokenizer = policy.tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in PROMPTS
    ]
    prompt_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts] * 4
    options = dict(
        model=policy.path,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
    )
    if args.mode == "adapter":
        options.update(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    started = time.perf_counter()
    llm = LLM(**options)
    print(f"engine start: {time.perf_counter() - started:.1f} s")

    from vllm.lora.request import LoRARequest

    folder = tempfile.mkdtemp(prefix="rlver-lora-")
    sync_seconds, generate_seconds, gaps = [], [], []
    for version in range(1, args.syncs + 1):
        perturb(policy.model, generator)
        started = time.perf_counter()
        request = None
        if args.mode == "merged":
            weights = list(inference_state_dict(policy.model).items())

            def reload(worker, weights=weights):
                worker.model_runner.reload_weights(weights_iterator=iter(weights))

            llm.collective_rpc(reload)
            llm.reset_prefix_cache()
        else:
            path = os.path.join(folder, f"v{version}")
            policy.model.save_pretrained(path)
            request = LoRARequest(f"policy-v{version}", version, path)
            if version > 1:
                llm.llm_engine.remove_lora(version - 1)
        sync_seconds.append(time.perf_counter() - started)

        params = [
            SamplingParams(temperature=1.0, max_tokens=40, seed=i, logprobs=0, detokenize=False)
            for i in range(len(prompt_ids))
        ]
        started = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
        generate_seconds.append(time.perf_counter() - started)  # includes loading the adapter (adapter mode)
        generations = []
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            generations.append((ids, [completion.logprobs[i][t].logprob for i, t in enumerate(ids)]))
        gaps.append(largest_gap(policy, prompt_ids, generations))
        print(
            f"sync {version}: {sync_seconds[-1]:.3f} s, generate {generate_seconds[-1]:.2f} s, "
            f"largest logprob gap {gaps[-1]:.2e}"
        )
    print(
        f"{args.mode}: median sync {statistics.median(sync_seconds):.3f} s, "
        f"median generate (16 x 40 tokens) {statistics.median(generate_seconds):.2f} s, "
        f"largest gap {max(gaps):.2e}"
    )


if __name__ == "__main__":
    main()
