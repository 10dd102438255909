"""`specd bootstrap-drafter` parses its own options (they used to be swallowed by the top-level parser)."""

import pytest

from specd.cluster.cli import build_parser
from specd.drafter_trainer.bootstrap import BootstrapConfig, config_from_options


def test_options_reach_the_bootstrap_config():
    args = build_parser().parse_args(
        ["bootstrap-drafter", "--quick", "--out", "/x/d", "--hidden-epochs", "1.5", "--if-missing"]
    )
    assert args.if_missing
    cfg = config_from_options(vars(args))
    quick = BootstrapConfig.quick()
    assert (cfg.num_prompts, cfg.max_new_tokens) == (quick.num_prompts, quick.max_new_tokens)
    assert cfg.out_dir == "/x/d" and cfg.hidden_epochs == 1.5
    assert str(cfg.resolved_hidden_out_dir()) == "/x/d-hidden"


def test_defaults_and_skipping_the_second_stage():
    cfg = config_from_options(vars(build_parser().parse_args(["bootstrap-drafter", "--no-target-hidden"])))
    assert cfg == BootstrapConfig(target_hidden=False)
    assert config_from_options(vars(build_parser().parse_args(["bootstrap-drafter"]))) == BootstrapConfig()


def test_second_stage_prompt_count():
    args = build_parser().parse_args(["bootstrap-drafter", "--hidden-num-prompts", "96"])
    full = config_from_options(vars(args))
    assert full.hidden_num_prompts == 96 and full.num_prompts == BootstrapConfig().num_prompts
    # the quick preset trains both stages on its own few prompts
    assert BootstrapConfig.quick().hidden_num_prompts is None


def test_sources_choose_what_the_drafter_learns_from():
    parse = build_parser().parse_args
    cfg = config_from_options(vars(parse(["bootstrap-drafter", "--quick", "--sources", "gsm8k, humaneval"])))
    assert cfg.sources == ("gsm8k", "humaneval") and cfg.num_prompts == BootstrapConfig.quick().num_prompts
    assert config_from_options(vars(parse(["bootstrap-drafter", "--quick"]))).sources == ("general",)
    for bad in ("gsm9k", "chat", ""):    # unknown, eval only, empty
        with pytest.raises(SystemExit):
            parse(["bootstrap-drafter", "--sources", bad])
