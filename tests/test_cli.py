"""The README's demo commands run end to end (small sizes) and print their tables."""
from services.cli import main


def test_demo_runs(tmp_path, capsys):
    assert main(["model-demo", "--tokens", "300", "--new-tokens", "2", "--chunk", "128", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prefill 300 tokens" in out and "ms/token" in out


def test_reuse_demo_runs_the_reuse_arm(tmp_path, capsys):
    assert main(["reuse-demo", "--workdir", str(tmp_path), "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "accepted" in out and "│ arm that ran" in out and "reuse" in out
    assert "FALLBACK" not in out
