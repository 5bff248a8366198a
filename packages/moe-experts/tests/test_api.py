"""The public surface is curated."""

import moe_experts


def test_all_is_curated() -> None:
    assert sorted(moe_experts.__all__) == sorted(
        [
            "ARCHITECTURES",
            "AdaptError",
            "ExpertPlaceholder",
            "KernelExperts",
            "LoadError",
            "load_pretrained",
            "BlockCheck",
            "BlockCoverage",
            "GradientCheckError",
            "MoECoverage",
            "Packing",
            "PackingError",
            "packed_model_inputs",
            "check_gradients",
            "coverage_report",
            "coverage_summary",
            "SelfCheckError",
            "TransformersVersionError",
            "UNSUPPORTED_FAMILIES",
            "ChunkedLossError",
            "MoEArchitecture",
            "MoEBlockSite",
            "PlaceholderAccessError",
            "UnsupportedModelError",
            "WrapError",
            "WrapReport",
            "__version__",
            "adapt",
            "adapt_model",
            "adapters_disabled",
            "chunked_lm_cross_entropy",
            "experts_sites",
            "find_architecture",
            "is_placeholder",
            "iter_moe_blocks",
            "make_placeholder",
            "named_placeholders",
            "peft_key_prefix",
            "router_targets",
            "wrap",
            "KERNEL_ATTENTION",
            "kernel_attention_forward",
            "register_kernel_attention",
            "use_kernel_attention",
            "use_kernel_norms",
            "GpuExperts",
            "GpuExpertsError",
            "GpuIdleMeter",
            "enable_gpu_experts",
            "enable_gradient_checkpointing",
            "enable_overlap",
            "idle_meter",
        ]
    )
    for name in moe_experts.__all__:
        assert getattr(moe_experts, name) is not None
        assert not name.startswith("_") or name == "__version__"


def test_version_matches_metadata() -> None:
    import importlib.metadata

    assert moe_experts.__version__ == importlib.metadata.version("moe-experts")
