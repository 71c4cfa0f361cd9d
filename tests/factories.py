"""Builders shared by the tests: engine requests, tiny random-weight models and the greedy reference check."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

TINY_VOCAB = 512


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int = 16, **sampling) -> Request:
    """An engine Request with its own SamplingParams (the scheduler and KV cache tests build these)."""
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, **sampling))


def tiny_config(arch: str = "llama", **overrides):
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    raise ValueError(arch)


def build_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a random-weight model (float32, safetensors) to `folder` and returns it."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; widen them so greedy choices are not near-ties.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return folder


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate(): the tokens and the raw logits of each step."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0] for step in out.logits]


def assert_greedy_equal(
    ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], max_margin: float = 1e-3
):
    """Token for token, or a difference only where the reference's top-2 logit margin is tiny."""
    for step, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a != b:
            top2 = ref_logits[step].float().topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < max_margin, f"step {step}: ours {a} vs transformers {b}, margin {margin:.3g} is no near-tie"
            return
    assert len(ours) == len(ref_tokens), f"lengths differ: ours {len(ours)}, transformers {len(ref_tokens)}"


def load_reference(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def build_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama with the default model's real tokenizer and chat template
    (vocabulary 49152), for end-to-end tests through the gateway."""
    import shutil

    from pdserve.engine.model_loader import resolve_model

    source = resolve_model("smollm2-135m").path
    build_tiny_model(folder, "llama", seed=seed, vocab_size=49152, eos_token_id=2, bos_token_id=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def build_test_certificates(folder: Path, ca_name: str = "test-ca") -> dict[str, str]:
    """A throwaway CA and one certificate it signed for 127.0.0.1 and localhost, made with the
    `cryptography` package (a test dependency): {"ca": ..., "cert": ..., "key": ...}, PEM paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def signed(subject_key, subject: str, issuer_key, issuer: str, extensions) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
        builder = builder.public_key(subject_key.public_key()).serial_number(x509.random_serial_number())
        builder = builder.not_valid_before(now - datetime.timedelta(minutes=5))
        builder = builder.not_valid_after(now + datetime.timedelta(days=1))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = signed(ca_key, ca_name, ca_key, ca_name, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = signed(key, "localhost", ca_key, ca_name, [(san, False)])
    paths = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "cert.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {kind: str(path) for kind, path in paths.items()}
