"""Architecture registry: every family resolves, unknown and refused models fail by name, and
packed rows keep their examples apart (SFT rows and preference pairs alike)."""

import copy
import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import kt_kernel
from moe_experts import (
    ARCHITECTURES,
    UNSUPPORTED_FAMILIES,
    Packing,
    PackingError,
    UnsupportedModelError,
    find_architecture,
    iter_moe_blocks,
    use_kernel_attention,
    use_kernel_norms,
    wrap,
)
from moe_experts.finetune.data import IGNORE_INDEX, Example, PackedBatches
from moe_experts.finetune.loss import token_loss_sum
from moe_experts.finetune.preference import sequence_logps
from moe_experts.finetune.preference_data import PairBatch, PairExample
from moe_experts.testing import TINY_CONFIGS

from .conftest import FAMILIES


def test_registry_rows_have_tiny_configs_and_are_frozen() -> None:
    # The list of families users fine-tune; every row has a tiny config, so the
    # parametrised suites (test_wrap, test_adapt) run it.
    required = {
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "deepseek_v3",
        "olmoe",
        "qwen3_5_moe",
        "qwen3_next",
        "qwen3_vl_moe",
        "glm4_moe",
        "glm4v_moe",
        "deepseek_v2",
        "ernie4_5_moe",
        "minimax",
        "hunyuan_v1_moe",
        "dots1",
        "phimoe",
        "granitemoe",
        "gpt_oss",
        "glm_moe_dsa",
        "kimi_linear",
        "jamba",
        "granitemoehybrid",
        "mistral4",
        "mistral_large4",
        "axk1",
        "axk2",
        "lara_mini",
        "dots3_note",
    }
    assert required <= set(ARCHITECTURES)
    assert set(TINY_CONFIGS) == set(ARCHITECTURES) == set(FAMILIES)
    assert not set(ARCHITECTURES) & set(UNSUPPORTED_FAMILIES)
    spec = ARCHITECTURES["mixtral"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.family = "x"  # type: ignore[misc]


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_found_with_router_and_shared_experts(fresh, family: str) -> None:
    model = fresh(family)
    arch = find_architecture(model)
    assert arch.family == family
    sites = list(iter_moe_blocks(model, arch))
    assert sites
    named = dict(model.named_parameters())
    for site in sites:
        experts = getattr(site.block, arch.experts_attr)
        gate_up = getattr(experts, arch.gate_up_param)
        e, i, h = arch.expert_dims(gate_up)
        assert h == model.config.get_text_config().hidden_size
        # Every stored expert tensor (weights and any biases) has the spec's layout, and
        # transformers' own layout flags agree with the spec's fields.
        for name, shape in arch.stored_shapes(e, i, h).items():
            assert tuple(getattr(experts, name).shape) == shape, name
        assert getattr(experts, "is_transposed", False) == arch.transposed
        assert getattr(experts, "is_concatenated", True) == (not arch.interleaved)
        assert getattr(experts, "has_bias", False) == bool(arch.bias_params)
        router = site.block.get_submodule(arch.router_attr).get_parameter(arch.router_param)
        # The router's [E, H] weight is where router LoRA goes (router_targets).
        assert tuple(router.shape) == (e, h)
        assert named[f"{site.name}.{arch.router_attr}.{arch.router_param}"] is router
        for attr in arch.shared_expert_attrs:
            assert isinstance(getattr(site.block, attr), torch.nn.Module)
        if arch.shared_expert_gate_attr:
            assert isinstance(getattr(site.block, arch.shared_expert_gate_attr), torch.nn.Linear)


def test_unsupported_model_lists_families() -> None:
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(UnsupportedModelError) as info:
        find_architecture(LlamaForCausalLM(cfg))
    msg = str(info.value)
    assert "llama" in msg
    for family in ARCHITECTURES:
        assert family in msg


@pytest.mark.parametrize(
    "model_type", ["llama4", "llama4_text", "longcat_flash", "muse_spark", "minimax_m3_vl_text"]
)
def test_refused_families_say_why(model_type: str) -> None:
    model = torch.nn.Module()
    model.config = type("Cfg", (), {"model_type": model_type})()
    with pytest.raises(UnsupportedModelError, match=model_type) as info:
        find_architecture(model)
    assert UNSUPPORTED_FAMILIES[model_type] in str(info.value)


def _pinned_transformers() -> str:
    constraints = Path(__file__).parents[3] / "constraints" / "current.txt"
    lines = constraints.read_text().splitlines()
    return next(line.split("==")[1] for line in lines if line.startswith("transformers=="))


def test_every_name_is_a_model_type_and_text_models_go_with_their_family() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if transformers.__version__ != _pinned_transformers():
        pytest.skip("model types are checked against the pinned transformers only")
    for arch in ARCHITECTURES.values():
        for model_type in arch.model_types:
            assert model_type in CONFIG_MAPPING_NAMES, (arch.family, model_type)
            text = f"{model_type}_text"
            assert text not in CONFIG_MAPPING_NAMES or text in arch.model_types, text
    for model_type in UNSUPPORTED_FAMILIES:
        assert model_type in CONFIG_MAPPING_NAMES, model_type
        text = f"{model_type}_text"
        assert text not in CONFIG_MAPPING_NAMES or text in UNSUPPORTED_FAMILIES, text


def test_refusals_name_only_kernel_activations_that_exist() -> None:
    # A reason that says what kt-kernel computes must name a class it has (no stale claims
    # such as "no clamped_swiglu yet" once ClampedSwiGLU exists).
    for model_type, why in UNSUPPORTED_FAMILIES.items():
        for name in re.findall(r"kt_kernel\.(\w+)", why):
            assert hasattr(kt_kernel, name), (model_type, name)
        assert "clamped_swiglu yet" not in why, model_type
    assert "kt_kernel.ClampedSwiGLU" in UNSUPPORTED_FAMILIES["minimax_m3_vl"]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_layout_fields_convert_to_kernel_layout(transposed: bool, interleaved: bool) -> None:
    # kt-kernel's layout: gate_up [E, 2I, H] with gate rows first, down [E, H, I].
    arch = dataclasses.replace(
        ARCHITECTURES["mixtral"], transposed=transposed, interleaved=interleaved
    )
    e, i, h = 3, 5, 7
    gate, up = torch.randn(e, i, h), torch.randn(e, i, h)
    down = torch.randn(e, h, i)
    bias = torch.randn(e, 2 * i)  # gate first, like the kernel's
    rows = torch.stack([gate, up], dim=2).flatten(1, 2) if interleaved else torch.cat([gate, up], 1)
    pairs = torch.stack(bias.unflatten(1, (2, i)).unbind(1), 2)  # [E, I, 2]
    stored_bias = pairs.flatten(1, 2) if interleaved else bias
    stored_gu = rows.transpose(1, 2) if transposed else rows
    stored_dn = down.transpose(1, 2) if transposed else down
    assert arch.expert_dims(stored_gu) == (e, i, h)
    shapes = arch.stored_shapes(e, i, h)
    assert shapes[arch.gate_up_param] == tuple(stored_gu.shape)
    assert shapes[arch.down_param] == tuple(stored_dn.shape)
    view = arch.kernel_gate_up(stored_gu)
    assert view.data_ptr() == stored_gu.data_ptr()  # a view, no copy
    assert torch.equal(view[:, 0], gate)
    assert torch.equal(view[:, 1], up)
    assert torch.equal(arch.kernel_down(stored_dn), down)
    assert torch.equal(arch.kernel_rows(stored_bias), bias)
    assert torch.equal(
        arch.kernel_rows(rows.transpose(0, 1), dim=0), torch.cat([gate, up], 1).transpose(0, 1)
    )


# Rows of 32 tokens hold two or three of these; the longest exceed the tiny configs' sliding
# windows (Gemma-4: 8, DeepSeek-V4: 4) and compression windows.
PACKED_LENGTHS = (13, 9, 6, 12, 4, 10)


def _packing_examples(vocab: int) -> list[Example]:
    """Conversation-like examples: two prompt tokens, the rest trained."""
    gen = torch.Generator().manual_seed(21)
    out = []
    for n in PACKED_LENGTHS:
        ids = tuple(int(t) for t in torch.randint(2, vocab, (n,), generator=gen))
        out.append(Example(ids, (False, False) + (True,) * (n - 2), ()))
    return out


def _placements(packed: PackedBatches, examples: list[Example]) -> dict[int, tuple[int, int]]:
    """Example index -> (row, first column), found from the restarting positions."""
    by_ids = {ex.ids: i for i, ex in enumerate(examples)}
    found = {}
    rows = zip(packed.rows.tolist(), packed.positions.tolist(), strict=True)
    for r, (row, pos) in enumerate(rows):
        starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in itertools.pairwise(starts):
            if tuple(row[a:b]) in by_ids:
                found[by_ids[tuple(row[a:b])]] = (r, a)
    assert len(found) == len(examples)
    return found


def _alone(model, ex: Example) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[n, V]`` and summed loss of one example run by itself (its own row)."""
    logits = model(input_ids=torch.tensor([ex.ids]), use_cache=False).logits[0]
    labels = [ex.ids[k + 1] if ex.train[k + 1] else IGNORE_INDEX for k in range(len(ex.ids) - 1)]
    loss = torch.nn.functional.cross_entropy(
        logits[:-1].float(), torch.tensor(labels), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return logits, loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_each_example_alone(fresh, family: str) -> None:
    """The CLI's packing and forward arguments: a packed row's logits and loss are each of its
    examples' run alone (fp32, 1e-5), in every family, on kt-kernel experts and attention."""
    model = fresh(family)
    arch = find_architecture(model)
    wrap(model, weight_dtype="fp32")
    use_kernel_attention(model)
    use_kernel_norms(model)
    examples = _packing_examples(min(model.config.get_text_config().vocab_size, 96))
    shares = arch.packing.shares_rows
    packed = PackedBatches.from_examples(
        examples, seq_len=31, batch_size=1, seed=0, one_per_row=not shares
    )
    n_rows = packed.rows.shape[0]
    assert n_rows == (2 if shares else len(examples))
    order = dataclasses.replace(packed, batch_size=n_rows)
    batch = order.model_batch(0)
    where = {row: i for i, row in enumerate(order._indices(0))}
    placed = _placements(packed, examples)
    with torch.no_grad():
        logits = model(**batch.model_inputs(model)).logits
        row_loss = torch.zeros(n_rows, dtype=torch.float64)
        for i, ex in enumerate(examples):
            r, a = placed[i]
            alone_logits, alone_loss = _alone(model, ex)
            got = logits[where[r], a : a + len(ex.ids)]
            torch.testing.assert_close(got, alone_logits, rtol=1e-5, atol=1e-5, msg=f"ex {i}")
            row_loss[where[r]] += alone_loss.double()
        for i in range(n_rows):
            loss = token_loss_sum(model, batch.select(i, i + 1))
            torch.testing.assert_close(loss.double(), row_loss[i], rtol=1e-5, atol=1e-5)
        if shares:
            # The check can fail: the same rows without boundaries give other logits.
            plain = model(input_ids=batch.input_ids, use_cache=False).logits
            assert (plain - logits).abs().max() > 1e-2
        else:
            # Rows packed for a family that shares them are refused, not silently mixed.
            crowded = PackedBatches.from_examples(examples, seq_len=31, batch_size=2, seed=0)
            with pytest.raises(PackingError, match=family):
                crowded.model_batch(0).model_inputs(model)


# (prompt, chosen, rejected) tokens of three pairs: six sequences that fill three 16-token rows.
# At most 8 tokens a sequence: then no sparse-attention indexer's top-k binds (index_topk 16;
# deepseek_v4's 4 blocks of 2). Where it binds, the tiny models' ReLU index scores tie at
# exactly 0 and torch.topk breaks the tie by the row's length, so a sequence alone and in a
# row pick different (equally scored) keys: the model's ambiguity, not packing's.
PAIR_LENGTHS = ((3, 4, 2), (5, 2, 3), (2, 4, 4))


def _response_logp(model, prompt: tuple[int, ...], response: tuple[int, ...]) -> torch.Tensor:
    """Summed log-probability of ``response`` after ``prompt``, the sequence run alone."""
    logits = model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0]
    logps = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
    return logps.gather(1, torch.tensor(response)[:, None]).sum()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_preference_pairs_score_each_sequence_alone(fresh, family: str) -> None:
    """DPO/ORPO's packing and forward arguments: a micro-batch's pairs packed as the family
    allows give each sequence's summed response log-prob of it run alone (fp32, 1e-5)."""
    model = fresh(family)
    arch = find_architecture(model)
    wrap(model, weight_dtype="fp32")
    use_kernel_attention(model)
    use_kernel_norms(model)
    vocab = min(model.config.get_text_config().vocab_size, 96)
    gen = torch.Generator().manual_seed(22)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(2, vocab, (n,), generator=gen))

    pairs = tuple(PairExample(ids(p), ids(c), ids(r)) for p, c, r in PAIR_LENGTHS)
    shares = arch.packing.shares_rows
    packed = PairBatch(pairs, seq_len=15, one_per_row=not shares).packed()
    assert packed.batch.input_ids.shape[0] == (3 if shares else 2 * len(pairs))
    with torch.no_grad():
        got = sequence_logps(model, packed)  # chosen 0..P-1, rejected P..2P-1
        want = torch.stack(
            [_response_logp(model, p.prompt, p.chosen) for p in pairs]
            + [_response_logp(model, p.prompt, p.rejected) for p in pairs]
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if shares:
            # The check can fail: the same rows without boundaries score other log-probs.
            batch, mask = packed.batch, packed.response
            logits = model(input_ids=batch.input_ids, use_cache=False).logits
            plain = logits[mask].float().log_softmax(-1)
            plain = plain.gather(1, batch.labels[mask][:, None]).squeeze(1)
            sums = plain.new_zeros(2 * len(pairs)).index_add(0, packed.segments[mask], plain)
            assert (sums - want).abs().max() > 1e-3
        else:
            # Pairs packed as for a family that shares rows are refused, not silently mixed.
            with pytest.raises(PackingError, match=family):
                sequence_logps(model, PairBatch(pairs, seq_len=15).packed())


def test_packing_choices_say_why() -> None:
    for arch in ARCHITECTURES.values():
        assert isinstance(arch.packing, Packing)
        assert arch.packing_reason
    # The recurrent, linear-attention and convolution families the issue names.
    assert {f for f, a in ARCHITECTURES.items() if not a.packing.shares_rows} >= {
        "qwen3_next",
        "qwen3_5_moe",
        "minimax",
        "lfm2_moe",
        "deepseek_v4",
        "kimi_linear",
        "jamba",
        "granitemoehybrid",
    }


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _plain_rms_norms(model: torch.nn.Module) -> set[str]:
    """Modules that are RMSNorms of one tensor with a weight (not gated, not centred)."""
    out = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        weight = getattr(module, "weight", None)
        if cls.endswith("RMSNorm") and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1:
            out.add(name)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_norms_switch_every_rms_norm_and_equal_its_own(fresh, family: str) -> None:
    """kt-kernel's fused RMSNorm in every family: each plain RMSNorm is switched, and logits
    and the embedding table's gradient equal the modules' own forwards (fp32 within 1e-5 and
    1e-4 relative; bf16 logits bitwise but for rare one-ulp ties); a deep copy's norms are
    bound to the copy."""
    for dtype in (torch.float32, torch.bfloat16):
        theirs = fresh(family).to(dtype)
        ours = copy.deepcopy(theirs)
        count = use_kernel_norms(ours)
        switched = {n for n, m in ours.named_modules() if "_kt_norm_form" in m.__dict__}
        assert count == len(switched)
        assert _plain_rms_norms(ours) <= switched, family
        assert use_kernel_norms(ours) == count  # idempotent
        ids = torch.randint(0, min(ours.config.get_text_config().vocab_size, 96), (2, 9))
        grads = []
        logits = []
        for model in (ours, theirs):
            # The embedding table's gradient: every norm's backward lies on its path (and
            # input_ids stay, which DeepSeek-V4's hash routing reads).
            table = model.get_input_embeddings().weight
            table.requires_grad_(True)
            out = model(input_ids=ids, use_cache=False).logits
            out.float().square().mean().backward()
            logits.append(out.detach().float())
            grads.append(table.grad.float())
        if dtype == torch.float32:
            assert _rel(logits[0], logits[1]) < 1e-5
            assert _rel(grads[0], grads[1]) < 1e-4
        else:
            assert float((logits[0] != logits[1]).float().mean()) <= 1e-3
            assert _rel(grads[0], grads[1]) < 2e-2
    twin = copy.deepcopy(ours)
    for name in switched:
        module = twin.get_submodule(name)
        assert module.forward.__self__ is module, name
