"""More allocator traces, recorded with the tool of `data/traces/tools/`, to check that soma's
fragmentation holds beyond the four models of `data/traces` (these traces are not part of the
repository: record them with the command below).

Each recipe runs a real `transformers` model with random weights on CPU and records every
allocation and free of PyTorch's allocator, in the format of `data/traces/README.md`:
batched decode with retiring rows (GPT-2, LLaMA, Mistral, a Mixtral-style mixture of
experts), a stream of requests with varying prompts, beam search, BERT / GPT-2 / LLaMA /
ResNet-50 training with varying shapes, T5 and Whisper generation, ViT, RoBERTa and
BERT-large with varying batch shapes.

Record (torch and transformers in any virtualenv; each recipe takes seconds to minutes,
`--list` prints every recipe, the bundled four included):

    python data/traces/tools/make_traces.py --recipes scripts/extra_trace_recipes.py \
        --out target/extra-traces gpt2_batch_retire_infer llama8_batch_retire_infer \
        bert_base_train t5_small_infer vit_base_infer gpt2_small_train_varlen \
        gpt2_serve_infer llama_tinyllama_long_infer roberta_dynamic_infer gpt2_beam_infer \
        mistral_small_infer llama_small_train bert_large_infer mixtral_moe_infer \
        resnet50_train whisper_tiny_infer

Then replay them:

    SOMA_TRACES=target/extra-traces SOMA_TRACES_JSON=traces-extra cargo bench --bench traces
    target/release/soma-replay target/extra-traces/gpt2_serve_infer.csv

The bench writes `traces-extra.json`, which `scripts/perf-report.py` renders as its own table
(`SOMA_EXTRA_TRACES=target/extra-traces` adds them to its repeated-runs table).
"""
import random

import torch

from make_traces import greedy_decode, load_weights_to_device, phase, recipe, _gpt2_config, _tinyllama_config, llm_dtype


def _left_padded(rng, vocab, lens):
    L = max(lens)
    ids = torch.randint(3, vocab, (len(lens), L))
    mask = torch.zeros(len(lens), L, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, L - n:] = 1
    return ids, mask


def _train_step(model, opt, **inputs):
    """One optimizer step on `inputs` (which include the labels); the loss is freed on return."""
    opt.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    opt.step()


@recipe("gpt2_batch_retire_infer", model="GPT-2 small", dtype="float32",
        workload="3 rounds: batch 8 left-padded prompts 16..300, 48 decode steps, rows retire")
def _gpt2_batch_retire(ctx):
    from transformers import GPT2LMHeadModel
    rng = random.Random(7)
    model = GPT2LMHeadModel(_gpt2_config()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for r in range(3):
            with phase(f"round{r}"):
                lens = [rng.randrange(16, 300) for _ in range(8)]
                ids, mask = _left_padded(rng, model.config.vocab_size, lens)
                retire = [rng.randrange(4, 48) for _ in range(8)]
                greedy_decode(model, ids, mask, n_decode=48, retire_after=retire)
                del ids, mask
    yield


@recipe("llama8_batch_retire_infer", model="LLaMA TinyLlama dims, 8 layers", dtype="bf16",
        workload="2 rounds: batch 4 left-padded prompts 64..400, 32 decode steps, rows retire")
def _llama_batch_retire(ctx):
    from transformers import AutoModelForCausalLM
    rng = random.Random(11)
    model = AutoModelForCausalLM.from_config(_tinyllama_config(8), dtype=llm_dtype()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for r in range(2):
            lens = [rng.randrange(64, 400) for _ in range(4)]
            ids, mask = _left_padded(rng, model.config.vocab_size, lens)
            retire = [rng.randrange(4, 32) for _ in range(4)]
            greedy_decode(model, ids, mask, n_decode=32, retire_after=retire)
            del ids, mask
    yield


@recipe("bert_base_train", model="BertForSequenceClassification base", dtype="float32",
        workload="6 fine-tuning steps, batch 8, padded lengths 32..384, AdamW")
def _bert_train(ctx):
    from transformers import BertConfig, BertForSequenceClassification
    rng = random.Random(3)
    model = BertForSequenceClassification(BertConfig(num_labels=3)).train()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for step in range(6):
        L = rng.randrange(32, 384)
        ids = torch.randint(1000, model.config.vocab_size, (8, L))
        labels = torch.randint(0, 3, (8,))
        _train_step(model, opt, input_ids=ids, labels=labels)
        del ids, labels
    yield


@recipe("t5_small_infer", model="T5 small", dtype="float32",
        workload="4 batches of 4: encoder lengths 64..400, 24 greedy decoder steps with cache")
def _t5_infer(ctx):
    from transformers import T5Config, T5ForConditionalGeneration
    rng = random.Random(5)
    model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0)).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for b in range(4):
            L = rng.randrange(64, 400)
            ids = torch.randint(5, model.config.vocab_size, (4, L))
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 min_new_tokens=24, do_sample=False)
            del out, ids
    yield


@recipe("vit_base_infer", model="ViT base patch16 224", dtype="float32",
        workload="8 batches, batch sizes 1..24")
def _vit_infer(ctx):
    from transformers import ViTConfig, ViTModel
    rng = random.Random(9)
    model = ViTModel(ViTConfig()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for b in range(8):
            x = torch.randn(rng.randrange(1, 25), 3, 224, 224)
            out = model(pixel_values=x).pooler_output.sum().item()
            del x
    yield


@recipe("gpt2_small_train_varlen", model="GPT-2 small", dtype="float32",
        workload="8 training steps, batch 4, sequence length random 64..512 per step, AdamW")
def _gpt2_train_varlen(ctx):
    from transformers import GPT2LMHeadModel
    rng = random.Random(21)
    model = GPT2LMHeadModel(_gpt2_config()).train()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    for step in range(8):
        ids = torch.randint(0, model.config.vocab_size, (4, rng.randrange(64, 512)))
        _train_step(model, opt, input_ids=ids, labels=ids)
        del ids
    yield


@recipe("gpt2_serve_infer", model="GPT-2 small", dtype="float32",
        workload="12 requests one after another, batch 1..4, prompts 8..700, decode 4..40 steps")
def _gpt2_serve(ctx):
    from transformers import GPT2LMHeadModel
    rng = random.Random(33)
    model = GPT2LMHeadModel(_gpt2_config()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for r in range(12):
            lens = [rng.randrange(8, 700) for _ in range(rng.randrange(1, 5))]
            ids, mask = _left_padded(rng, model.config.vocab_size, lens)
            greedy_decode(model, ids, mask, n_decode=rng.randrange(4, 40))
            del ids, mask
    yield


@recipe("llama_tinyllama_long_infer", model="LLaMA TinyLlama dims, 22 layers", dtype="bf16",
        workload="batch 2 left-padded prompts 900 and 1500, 24 decode steps, one row retires at 8")
def _llama_long(ctx):
    from transformers import AutoModelForCausalLM
    rng = random.Random(44)
    model = AutoModelForCausalLM.from_config(_tinyllama_config(22), dtype=llm_dtype()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        ids, mask = _left_padded(rng, model.config.vocab_size, [900, 1500])
        greedy_decode(model, ids, mask, n_decode=24, retire_after=[8, 24])
        del ids, mask
    yield


@recipe("roberta_dynamic_infer", model="RoBERTa base", dtype="float32",
        workload="24 batches: batch 1..32, padded lengths 16..512")
def _roberta(ctx):
    from transformers import RobertaConfig, RobertaModel
    rng = random.Random(55)
    model = RobertaModel(RobertaConfig()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for b in range(24):
            B, L = rng.randrange(1, 33), rng.randrange(16, 513)
            ids = torch.randint(5, model.config.vocab_size, (B, L))
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.sum().item()
            del ids
    yield


@recipe("gpt2_beam_infer", model="GPT-2 small", dtype="float32",
        workload="3 prompts (batch 2, lengths 40..300), generate() beam search 4 beams, 32 new tokens")
def _gpt2_beam(ctx):
    from transformers import GPT2LMHeadModel
    rng = random.Random(66)
    model = GPT2LMHeadModel(_gpt2_config()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for r in range(3):
            L = rng.randrange(40, 300)
            ids = torch.randint(5, model.config.vocab_size, (2, L))
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=4,
                                 max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
            del out, ids
    yield


@recipe("mistral_small_infer", model="Mistral architecture, hidden 1024, 8 layers, sliding window 256", dtype="bf16",
        workload="batch 4 left-padded prompts 100..600, 40 decode steps, rows retire")
def _mistral(ctx):
    from transformers import MistralConfig, MistralForCausalLM
    rng = random.Random(77)
    cfg = MistralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=4, sliding_window=256,
                        max_position_embeddings=4096, pad_token_id=0)
    model = MistralForCausalLM(cfg).to(llm_dtype()).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        lens = [rng.randrange(100, 600) for _ in range(4)]
        ids, mask = _left_padded(rng, cfg.vocab_size, lens)
        greedy_decode(model, ids, mask, n_decode=40, retire_after=[rng.randrange(5, 40) for _ in range(4)])
        del ids, mask
    yield


@recipe("llama_small_train", model="LLaMA architecture, hidden 1024, 4 layers", dtype="float32",
        workload="6 training steps, batch 2, lengths 128..768, AdamW")
def _llama_train(ctx):
    from transformers import LlamaConfig, LlamaForCausalLM
    rng = random.Random(88)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, pad_token_id=0)
    model = LlamaForCausalLM(cfg).train()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for step in range(6):
        ids = torch.randint(3, cfg.vocab_size, (2, rng.randrange(128, 768)))
        _train_step(model, opt, input_ids=ids, labels=ids)
        del ids
    yield


@recipe("bert_large_infer", model="BERT large", dtype="float32",
        workload="12 batches: batch 1..16, padded lengths 16..512")
def _bert_large(ctx):
    from transformers import BertConfig, BertModel
    rng = random.Random(99)
    model = BertModel(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096)).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for b in range(12):
            B, L = rng.randrange(1, 17), rng.randrange(16, 513)
            ids = torch.randint(1000, 30000, (B, L))
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).pooler_output.sum().item()
            del ids
    yield


@recipe("mixtral_moe_infer", model="Mixtral architecture (MoE), hidden 512, 4 layers, 8 experts top-2",
        dtype="float32", workload="batch 4 left-padded prompts 50..400, 32 decode steps, rows retire")
def _mixtral(ctx):
    from transformers import MixtralConfig, MixtralForCausalLM
    rng = random.Random(111)
    cfg = MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                        num_experts_per_tok=2, max_position_embeddings=2048, pad_token_id=0)
    model = MixtralForCausalLM(cfg).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        lens = [rng.randrange(50, 400) for _ in range(4)]
        ids, mask = _left_padded(rng, cfg.vocab_size, lens)
        greedy_decode(model, ids, mask, n_decode=32, retire_after=[rng.randrange(4, 32) for _ in range(4)])
        del ids, mask
    yield


@recipe("resnet50_train", model="ResNet-50 (transformers ResNetForImageClassification)", dtype="float32",
        workload="4 training steps, batch sizes 4..12 at 224x224, SGD with momentum")
def _resnet_train(ctx):
    from transformers import ResNetConfig, ResNetForImageClassification
    rng = random.Random(122)
    model = ResNetForImageClassification(ResNetConfig(num_labels=100)).train()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    for step in range(4):
        b = rng.randrange(4, 13)
        x = torch.randn(b, 3, 224, 224)
        labels = torch.randint(0, 100, (b,))
        _train_step(model, opt, pixel_values=x, labels=labels)
        del x, labels
    yield


@recipe("whisper_tiny_infer", model="Whisper tiny architecture", dtype="float32",
        workload="3 clips of 30 s log-mel features (batch 1..3), generate() greedy, 24 new tokens")
def _whisper(ctx):
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    rng = random.Random(133)
    cfg = WhisperConfig(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536)
    model = WhisperForConditionalGeneration(cfg).eval()
    yield
    with phase("load_weights"):
        load_weights_to_device(model)
    with torch.inference_mode():
        for r in range(3):
            feats = torch.randn(rng.randrange(1, 4), cfg.num_mel_bins, 3000)
            out = model.generate(input_features=feats, max_new_tokens=24, min_new_tokens=24, do_sample=False)
            del out, feats
    yield
