"""bench/serve_vllm.py's pure parts: what each server runs with, and the ratios it reports."""

from __future__ import annotations

from specd.bench.serve_vllm import SYSTEMS, ratios, round_ratios, server_overrides
from specd.configs import load_config


def test_each_server_is_the_vllm_backend_with_its_own_speculation_and_the_operators_overrides() -> None:
    for system in SYSTEMS:
        cfg = load_config(server_overrides(system, ["drafter=ngram"], max_clients=16))
        assert cfg.target.backend.value == "vllm" and cfg.target.max_slots == 16
        assert cfg.server.max_running == 16 and cfg.drafter.kind == "ngram"
        assert not cfg.replay.enabled and not cfg.trainer.enabled
    assert not load_config(server_overrides("vllm", [], 4)).spec.enabled
    ngram = load_config(server_overrides("vllm-ngram", [], 4))
    assert ngram.spec.enabled and ngram.target.vllm_speculation == "vllm-ngram"
    specd = load_config(server_overrides("specd-vllm", [], 4))
    assert specd.spec.enabled and specd.target.vllm_speculation == "specd"
    native = load_config(server_overrides("specd-draft-model", [], 4))
    assert native.spec.enabled and native.target.vllm_speculation == "vllm-draft-model"


def test_ratios_divide_by_vllm_alone_at_the_same_client_count() -> None:
    results = {"vllm c4": {"tokens_per_s": 10.0}, "specd-vllm c4": {"tokens_per_s": 12.0},
               "vllm-ngram c4": {"tokens_per_s": 9.0}, "vllm c16": {"tokens_per_s": 20.0},
               "specd-vllm c16": {"tokens_per_s": 25.0}}
    assert ratios(results, [4, 16]) == {"vllm-ngram_vs_vllm_c4": 0.9, "specd-vllm_vs_vllm_c4": 1.2,
                                        "specd-vllm_vs_vllm_c16": 1.25}


def test_round_ratios_pair_the_servers_of_each_round() -> None:
    def rounds(*tps):
        return {"rounds": [{"tokens_per_s": t} for t in tps]}

    results = {"vllm c4": rounds(10.0, 20.0), "specd-vllm c4": rounds(12.0, 18.0),
               "vllm-ngram c4": rounds(10.0, 30.0)}
    out = round_ratios(results, [4])
    assert out["specd-vllm_vs_vllm_c4_rounds"] == [1.2, 0.9] and out["specd-vllm_vs_vllm_c4_median"] == 1.05
    assert out["vllm-ngram_vs_vllm_c4_median"] == 1.25
