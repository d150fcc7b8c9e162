"""Exercise the CUDA cache store for compute-sanitizer (memcheck).

    compute-sanitizer --tool memcheck python3 scripts/memcheck_store.py {valid,negative,checked_oob,unchecked_oob}

valid          in-range slots at page boundaries (last of a page, first of the next, last overall)
negative       negative slots mixed with valid ones: nothing written for them
checked_oob    a slot == capacity in checked mode: a ValueError before any launch, cache unchanged
unchecked_oob  a slot == capacity without checked mode: undefined behaviour by contract (the kernel
               writes past the cache); memcheck is expected to report it
"""

import sys

import torch

import dsv4_compile as d4


def main(case: str) -> None:
    page_size, pages = 64, 4
    cache = d4.alloc_cache(pages, page_size, "cuda")
    cap = pages * page_size
    slots = {
        "valid": [page_size - 1, page_size, cap - 1, 0],
        "negative": [-1, 5, -7, cap - 1],
        "checked_oob": [0, cap, 1, 2],
        "unchecked_oob": [0, cap + 40 * page_size, 1, 2],
    }[case]
    kv = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    args = (kv, torch.ones(512, dtype=torch.bfloat16, device="cuda"), torch.randn(16, 64, device="cuda"),
            torch.arange(4, device="cuda"), torch.tensor(slots, device="cuda"), cache, 1e-6, page_size)
    before = cache.clone()
    print("provider:", d4.providers("cuda")["fused_k_norm_rope_flashmla"])
    if case == "checked_oob":
        with d4.checked():
            try:
                d4.fused_k_norm_rope_flashmla(*args)
            except ValueError as exc:
                print("rejected:", exc)
        torch.cuda.synchronize()
        print("cache unchanged:", torch.equal(cache, before))
        return
    d4.fused_k_norm_rope_flashmla(*args)
    torch.cuda.synchronize()
    print("bytes changed:", int((cache != before).sum()))


if __name__ == "__main__":
    main(sys.argv[1])
