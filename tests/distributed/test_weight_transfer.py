"""RL weight sync (``vllm.distributed.weight_transfer``): the wire layout, the checks of
what a trainer sends, and whole rounds into an offline ``LLM`` over gloo, checked against
transformers on the same new weights."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from vllm.distributed.weight_transfer import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    LLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.base import (
    pack_plan,
    parse_update_info,
    update_info_of,
)
from vllm.distributed.weight_transfer.torch_group import (
    open_group,
    receive_tensors,
    send_tensors,
)
from vllm.outputs import WeightVersionSpan


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the wire ---------------------------------------------------------------------------


def test_pack_plan_cuts_buffers_at_the_limit_and_aligns_offsets():
    metas = [
        ParamMeta("a", torch.float32, (3,)),  # 12 bytes
        ParamMeta("b", torch.bfloat16, (5,)),  # 10 bytes at 64
        ParamMeta("c", torch.float32, (40,)),  # 160 bytes: 128 + 160 > 200, a new buffer
        ParamMeta("d", torch.float32, (100,)),  # 400 bytes > 200: alone
        ParamMeta("e", torch.int8, (0,)),
    ]
    plan = pack_plan(metas, 200)
    assert [b.entries for b in plan] == [((0, 0), (1, 64)), ((2, 0),), ((3, 0),), ((4, 0),)]
    assert [b.nbytes for b in plan] == [74, 160, 400, 0]
    assert [b.entries for b in pack_plan(metas, 1 << 20)] == [
        ((0, 0), (1, 64), (2, 128), (3, 320), (4, 768))
    ]


@pytest.mark.parametrize("packed", [True, False])
def test_send_and_receive_every_dtype_over_gloo(packed):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 3, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "i64": torch.arange(5),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    port, got, errors = free_port(), {}, []

    def engine():
        try:
            group = open_group("gloo", "127.0.0.1", port, 1, 2, 30)
            receive_tensors(group, metas, torch.device("cpu"), packed, 100, 2, got.__setitem__)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=engine)
    thread.start()
    group = open_group("gloo", "127.0.0.1", port, 0, 2, 30)
    send_tensors(group, metas, iter(tensors.values()), torch.device("cpu"), packed, 100, 2)
    thread.join(30)
    assert not errors and list(got) == list(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_update_info_round_trips_and_bad_ones_name_their_key():
    metas = [ParamMeta("w", torch.bfloat16, (2, 3)), ParamMeta("b", torch.float32, ())]
    assert parse_update_info(update_info_of(metas)) == metas
    good = update_info_of(metas)
    for bad, words in [
        ({**good, "packed": True}, "does not take: ['packed']"),
        ({k: v for k, v in good.items() if k != "shapes"}, "lacks ['shapes']"),
        ({**good, "names": ["w"]}, "differ in length"),
        ({**good, "dtype_names": ["bfloat16", "float33"]}, "dtype_names[1]"),
        ({**good, "shapes": [[2, -3], []]}, "shapes[0]"),
        ({**good, "names": ["w", "w"]}, "a name twice"),
        ([], "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=repr(words)[1:-1].replace("[", r"\[")):
            parse_update_info(bad)


def test_init_info_is_checked_key_by_key():
    good = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 2}  # fmt: skip
    assert WeightTransferInitInfo.parse(good).packed is False  # vLLM's engine-side default
    for bad, words in [
        ({**good, "nccl_unique_id_b64": "x"}, "does not take"),
        ({k: v for k, v in good.items() if k != "world_size"}, "lacks"),
        ({**good, "master_port": 0}, "master_port"),
        ({**good, "rank_offset": 0}, "rank_offset"),
        ({**good, "world_size": 1}, "world_size"),
        ({**good, "packed": "yes"}, "packed"),
        ({**good, "packed_num_buffers": 0}, "packed_num_buffers"),
        ({**good, "timeout_s": -1}, "timeout_s"),
    ]:
        with pytest.raises(ValueError, match=words):
            WeightTransferInitInfo.parse(bad)


# -- whole rounds into an offline LLM -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama checkpoint, and transformers' model of it (fp32)."""
    import transformers

    from tests.tiny_models import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path)
    return path, transformers.LlamaForCausalLM.from_pretrained(path).eval()


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 8]]


def greedy(llm, prompts=PROMPTS, n=8) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def spans(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    return out.outputs[0].weight_versions


def make_llm(path, **kwargs):
    from vllm import LLM

    return LLM(model=str(path), skip_tokenizer_init=True, max_model_len=128,
               kv_cache_memory="8MiB", enable_prefix_caching=True,
               weight_transfer_config={"backend": "gloo"}, **kwargs)  # fmt: skip


def new_weights(hf, seed: int):
    """A copy of ``hf`` whose every parameter moved by seeded noise (a training step)."""
    import copy

    trained = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=0.02))
    return trained


def push(llm, model, version: str | None, packed: bool = True, buffer: int = 1 << 30):
    """trainer_init (first time) and one round of ``model``'s weights into ``llm``."""
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                            packed=packed, packed_buffer_size_bytes=buffer, timeout_s=60),
        client=LLMWeightSyncClient(llm), source=ModuleSource(model),
    )  # fmt: skip
    trainer.send_weights(weight_version=version)
    return trainer


@pytest.mark.parametrize("packed", [True, False])
def test_a_round_serves_the_trainers_new_weights(tiny, packed):
    from tests.tiny_models import hf_greedy

    path, hf = tiny
    llm = make_llm(path)
    try:
        assert greedy(llm) == hf_greedy(hf, PROMPTS, 8)
        assert spans(llm) == [WeightVersionSpan("default", 0, 8)]
        before = llm.compute_weight_checksums()
        trained = new_weights(hf, seed=1)
        expected = hf_greedy(trained, PROMPTS, 8)
        assert expected != hf_greedy(hf, PROMPTS, 8)
        # a small buffer: the packed round spans many broadcasts
        trainer = push(llm, trained, "step-1", packed=packed, buffer=4096)
        assert llm.get_weight_version() == "step-1"
        assert greedy(llm) == expected  # and no prefix hit on KV of the old weights
        assert spans(llm) == [WeightVersionSpan("step-1", 0, 8)]  # which weights sampled
        after = llm.compute_weight_checksums()
        assert before.keys() == after.keys() and all(before[k] != after[k] for k in before)
        # A second round over the same group, back to the first weights.
        trainer.send_weights()
        trainer.init_info  # noqa: B018
        trainer.source = ModuleSource(hf)
        trainer.send_weights(weight_version="step-2")
        assert greedy(llm) == hf_greedy(hf, PROMPTS, 8)
        assert llm.compute_weight_checksums() == before
        assert llm.get_weight_version() == "step-2"
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()


def test_calls_out_of_order_and_bad_rounds_fail_alone(tiny):
    from vllm.distributed.weight_transfer.base import update_info_of

    path, hf = tiny
    llm = make_llm(path)
    try:
        before, served = llm.compute_weight_checksums(), greedy(llm)
        for call, words in [
            (llm.start_weight_update, "init_weight_transfer_engine first"),
            (lambda: llm.update_weights({"update_info": {}}), "init_weight_transfer_engine"),
            (llm.finish_weight_update, "start_weight_update first"),
            (lambda: llm.init_weight_transfer_engine({"info": {}}), "'init_info'"),
            (lambda: llm.init_weight_transfer_engine({"init_info": {"x": 1}}), "does not take"),
            # a group with a rank no one takes would wait out its timeout: refused now
            (
                lambda: llm.init_weight_transfer_engine(
                    {
                        "init_info": {
                            "master_address": "127.0.0.1",
                            "master_port": 1,
                            "rank_offset": 1,
                            "world_size": 3,
                        }
                    }
                ),  # fmt: skip
                "world_size 3 must be rank_offset 1 \\+ one engine = 2",
            ),
        ]:
            with pytest.raises(ValueError, match=words):
                call()
        trained = new_weights(hf, seed=2)
        trainer = push(llm, trained, "v1")
        served_v1, v1 = greedy(llm), llm.compute_weight_checksums()
        llm.start_weight_update()
        with pytest.raises(ValueError, match="in progress"):
            llm.start_weight_update()
        llm.finish_weight_update()  # an empty round: the weights of before, again
        assert llm.compute_weight_checksums() == v1
        with pytest.raises(ValueError, match="start_weight_update first"):
            llm.finish_weight_update()
        partial = ModuleSource(trained)
        # A tensor of the wrong shape: refused, nothing copied.
        wrong = _Only(trained, partial.metadata(), reshape="model.norm.weight")
        trainer.source = wrong
        with pytest.raises(ValueError, match="do not fit the model"):
            trainer.send_weights()
        assert greedy(llm) == served_v1 and served_v1 != served
        assert llm.compute_weight_checksums() == v1
        trainer.source = ModuleSource(hf)  # and a good round still goes through
        trainer.send_weights(weight_version="v3")
        assert llm.compute_weight_checksums() == before and greedy(llm) == served
        assert (
            update_info_of(ModuleSource(hf).metadata())["names"][0] == "model.embed_tokens.weight"
        )
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()


class _Only(ModuleSource):
    """``module``'s parameters limited to ``metas`` (a partial round), one of them
    (``reshape``) sent with a wrong shape."""

    def __init__(self, module, metas, reshape: str | None = None):
        super().__init__(module)
        self.keep, self.reshape = {m.name for m in metas}, reshape

    def _tensor(self, name, tensor):
        return torch.cat([tensor, tensor]) if name == self.reshape else tensor

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self]

    def __iter__(self):
        for name, tensor in super().__iter__():
            if name in self.keep:
                yield name, self._tensor(name, tensor)


def test_a_quantized_model_and_an_engine_without_the_flag_refuse():
    from vllm import LLM

    llm = LLM(max_model_len=128, kv_cache_memory="8MiB", weight_transfer_config={})
    try:
        if llm.engine_core.model_runner.model.weight_format == "fp32":
            pytest.skip("the embedded model is served dense here (no native GGUF kernels)")
        init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                "world_size": 2}  # fmt: skip
        with pytest.raises(
            ValueError, match="served in a dense dtype; this one's weights are gguf"
        ):
            llm.init_weight_transfer_engine({"init_info": init})
    finally:
        llm.shutdown()


def test_without_the_flag_the_calls_say_which_flag(tiny):
    from vllm import LLM

    llm = LLM(model=str(tiny[0]), skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory="8MiB")  # fmt: skip
    try:
        with pytest.raises(ValueError, match="--weight-transfer-config"):
            llm.start_weight_update()
        assert llm.get_weight_version() == "default"
        llm.update_weight_version("mine")
        assert llm.get_weight_version() == "mine"
    finally:
        llm.shutdown()


def test_a_lora_engine_takes_updates_of_its_base_weights(tiny):
    from tests.tiny_models import hf_greedy

    path, hf = tiny
    llm = make_llm(path, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        trained = new_weights(hf, seed=3)
        push(llm, trained, None).shutdown()
        assert greedy(llm) == hf_greedy(trained, PROMPTS, 8)
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()


def test_a_partial_round_replaces_only_its_tensors(tiny):
    """vLLM's partial updates: the round's tensors on top of the weights served."""
    from tests.tiny_models import hf_greedy

    path, hf = tiny
    trained = new_weights(hf, seed=4)
    mlp = [m for m in ModuleSource(trained).metadata() if ".mlp." in m.name]
    expected_model = new_weights(hf, seed=4)  # the base, with the trained MLPs only
    with torch.no_grad():
        base = dict(hf.named_parameters())
        for name, p in expected_model.named_parameters():
            if ".mlp." not in name:
                p.copy_(base[name])
    expected = hf_greedy(expected_model, PROMPTS, 8)
    assert expected not in (hf_greedy(hf, PROMPTS, 8), hf_greedy(trained, PROMPTS, 8))
    llm = make_llm(path)
    try:
        push_source = _Only(trained, mlp)
        trainer = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                timeout_s=60),
            client=LLMWeightSyncClient(llm), source=push_source,
        )  # fmt: skip
        trainer.send_weights(weight_version="mlp-only")
        assert greedy(llm) == expected
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()


def test_with_dummy_weights_the_first_round_must_be_whole(tiny):
    path, hf = tiny
    llm = make_llm(path, load_format="dummy")
    try:
        trained = new_weights(hf, seed=5)
        partial = _Only(trained, [m for m in ModuleSource(trained).metadata()
                                  if "layers.1.mlp" not in m.name])  # fmt: skip
        trainer = GlooTrainerWeightTransferEngine.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                timeout_s=60),
            client=LLMWeightSyncClient(llm), source=partial,
        )  # fmt: skip
        with pytest.raises(ValueError, match="lacks the checkpoint tensor 'layers.1.mlp"):
            trainer.send_weights()
        trainer.source = ModuleSource(trained)  # a whole round, then partial ones
        trainer.send_weights()
        trainer.source = partial
        trainer.send_weights()
        from tests.tiny_models import hf_greedy

        ours, theirs = greedy(llm), hf_greedy(trained, PROMPTS, 8)
        # transformers stops at the EOS id (2), the engine here ignores it
        assert [o[: len(t)] for o, t in zip(ours, theirs, strict=True)] == theirs
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.shutdown()
