"""float32 versus bf16 autocast on CPU for generation and a training step (SmolLM2-135M).

.venv/bin/python benchmarks/cpu_precision.py
"""

from __future__ import annotations

import time

import torch
from rlver_plugins.hf_engine import HFEngine

from rlver.core.interfaces import SamplingSettings
from rlver.modeling.models import load_policy


def main() -> None:
    policy = load_policy("smollm2-135m-instruct")
    tokenizer = policy.tokenizer
    engine = HFEngine(policy, batch_size=16)
    chats = [
        [
            {
                "role": "system",
                "content": "You are an intelligent chat partner who chats with users with high EQ.",
            },
            {"role": "user", "content": f"My boss yelled at me today in front of everyone ({i})."},
        ]
        for i in range(8)
    ]
    prompts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for c in chats
    ]
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            engine.generate(prompts[:2], SamplingSettings(max_new_tokens=4, seed=1))  # warm-up
            started = time.perf_counter()
            generations = engine.generate(prompts, SamplingSettings(max_new_tokens=48, seed=1))
            seconds = time.perf_counter() - started
        tokens = sum(len(g.token_ids) for g in generations)
        print(f"generate, bf16 autocast={autocast}: {tokens} tokens, {tokens / seconds:.1f} tokens/s")

    ids = torch.randint(100, 40000, (8, 300))
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6)
    policy.model.train()
    for autocast in (False, True):
        for repeat in range(2):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = policy.model(input_ids=ids).logits
                loss = torch.log_softmax(logits.float(), -1)[..., 5].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds = time.perf_counter() - started
            print(f"train step 8x300, bf16 autocast={autocast}, run {repeat}: {seconds:.1f} s")


if __name__ == "__main__":
    main()
