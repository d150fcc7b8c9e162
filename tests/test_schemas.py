"""The op schemas are the contract: pinned here so any change is a visible diff."""

import expecttest
import torch

import dsv4_compile  # noqa: F401


def schema(name: str) -> str:
    return str(getattr(torch.ops.dsv4, name).default._schema)


class TestSchemas(expecttest.TestCase):
    def test_store(self):
        self.assertExpectedInline(
            schema("fused_k_norm_rope_flashmla"),
            """dsv4::fused_k_norm_rope_flashmla(Tensor kv, Tensor kv_weight, Tensor freqs, Tensor positions, Tensor out_loc, Tensor(a!) kvcache, float eps, int page_size, str kv_format="v4") -> ()""",
        )

    def test_quantize_store(self):
        self.assertExpectedInline(
            schema("quantize_store"),
            """dsv4::quantize_store(Tensor kv, Tensor out_loc, Tensor(a!) kvcache, int page_size, str kv_format="v4") -> ()""",
        )

    def test_decode(self):
        self.assertExpectedInline(
            schema("flash_mla_with_kvcache"),
            """dsv4::flash_mla_with_kvcache(Tensor q, Tensor k_cache, int page_size, Tensor indices, Tensor? topk_length, Tensor? attn_sink, Tensor? extra_k_cache, int extra_page_size, Tensor? extra_indices, Tensor? extra_topk_length, Tensor? tile_scheduler_metadata, Tensor? num_splits, float softmax_scale, int head_dim_v, str kv_format="v4", str? extra_kv_format=None, bool batch_invariant=False) -> (Tensor out, Tensor lse)""",
        )

    def test_prefill(self):
        self.assertExpectedInline(
            schema("flash_mla_sparse_fwd"),
            """dsv4::flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, Tensor? attn_sink=None, Tensor? topk_length=None, bool batch_invariant=False) -> (Tensor out, Tensor max_logits, Tensor lse)""",
        )

    def test_metadata(self):
        self.assertExpectedInline(
            schema("get_mla_metadata"),
            """dsv4::get_mla_metadata(Tensor q, Tensor indices, Tensor? topk_length, Tensor? extra_indices, Tensor? extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)""",
        )

    def test_metadata_stacked(self):
        self.assertExpectedInline(
            schema("get_mla_metadata_stacked"),
            """dsv4::get_mla_metadata_stacked(Tensor q, int[] topk, Tensor?[] topk_length, int[] extra_topk, Tensor?[] extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)""",
        )

    def test_indexer_logits(self):
        self.assertExpectedInline(
            schema("indexer_logits"),
            """dsv4::indexer_logits(Tensor q, Tensor weights, Tensor keys, Tensor block_slots, bool batch_invariant=False) -> Tensor""",
        )

    def test_indexer_topk(self):
        self.assertExpectedInline(
            schema("indexer_topk"),
            """dsv4::indexer_topk(Tensor logits, int k) -> Tensor""",
        )

    def test_indexer_store(self):
        self.assertExpectedInline(
            schema("indexer_store"),
            """dsv4::indexer_store(Tensor keys, Tensor(a!) index_cache, Tensor slots, int page_size, str index_format="fp8") -> ()""",
        )

    def test_indexer_cache_logits(self):
        self.assertExpectedInline(
            schema("indexer_cache_logits"),
            """dsv4::indexer_cache_logits(Tensor q, Tensor weights, Tensor index_cache, Tensor block_slots, int page_size, str index_format="fp8", Tensor? q_scales=None, bool batch_invariant=False) -> Tensor""",
        )

    def test_indexer_cache_topk(self):
        self.assertExpectedInline(
            schema("indexer_cache_topk"),
            """dsv4::indexer_cache_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor block_table, Tensor table_rows, Tensor lengths, int page_size, int k, str index_format="fp8", Tensor? q_scales=None, bool batch_invariant=False) -> Tensor""",
        )

    def test_rope_(self):
        self.assertExpectedInline(
            schema("rope_"),
            """dsv4::rope_(Tensor(a!) x, Tensor freqs, Tensor positions, bool inverse=False) -> ()""",
        )

    def test_only_the_caches_and_the_rotated_tensor_are_mutable(self):
        for name in dsv4_compile.dispatch.OPS:
            args = getattr(torch.ops.dsv4, name).default._schema.arguments
            written = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
            stores = ("fused_k_norm_rope_flashmla", "quantize_store")
            expected = (["kvcache"] if name in stores else ["x"] if name == "rope_"
                        else ["index_cache"] if name == "indexer_store" else [])
            self.assertEqual(written, expected)

    def test_no_composite_implicit_kernel(self):
        # CompositeImplicitAutograd would decompose the op under compile; it must stay one node.
        for name in dsv4_compile.dispatch.OPS:
            qualname = f"dsv4::{name}"
            self.assertFalse(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeImplicitAutograd"))
            for key in ("CPU", "CUDA", "XPU", "CompositeExplicitAutograd", "Meta"):
                self.assertTrue(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (name, key))
