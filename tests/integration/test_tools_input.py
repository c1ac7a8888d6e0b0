"""zctl's reading of a verb's arguments: a job id is a decimal integer from
1 ("-1" is not the largest job id), and an argument a verb does not take (a
second job id, an option without its value, a word after the options) is
an error naming it, with nothing sent to the coordinator, instead of being
dropped while the rest of the command runs."""
from ztest import byte_dataset, http_get, submit, tiny_spec, zctl

HB = 200


def state(coord, jid):
    return http_get(coord.http_port, f"/v1/jobs/{jid}")[2]["state"]


def test_zctl_refuses_unpaired_and_extra_arguments(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord(hb_ms=HB)
    jid = submit(coord, tiny_spec(train, val, 5), tmp_path)  # no workers: it stays pending
    assert state(coord, jid) == "pending"
    for args, why in ((["cancel", str(jid), "4"], 'cancel: unexpected argument "4"'),
                      (["pause", str(jid), "now"], 'pause: unexpected argument "now"'),
                      (["cancel", str(jid), "--to-step"], "cancel: --to-step needs a value"),
                      (["rollback", str(jid), "--to-step", "40", "--skip"],
                       "rollback: --skip needs a value"),
                      (["rollback", str(jid), "--to-step", "40", "7"],
                       'rollback: unexpected argument "7"'),
                      (["metrics", str(jid), "--from", "0", "--to"], "metrics: --to needs a value"),
                      (["metrics", str(jid), "extra"], 'metrics: unexpected argument "extra"'),
                      (["logbook", str(jid), "--markdown", "extra"], "logbook: usage:")):
        r = zctl(coord.grpc, *args, check=False)
        assert r.returncode != 0 and why in r.stderr, (args, r.returncode, r.stdout, r.stderr)
        assert r.stdout == "", (args, r.stdout)
        assert state(coord, jid) == "pending", args
    # The command itself, spelled right, does act: the refusals above were
    # not the coordinator's.
    assert "cancel" in zctl(coord.grpc, "cancel", str(jid)).stdout.lower()
    assert state(coord, jid) == "canceled"


def test_zctl_job_ids_are_positive_decimal_integers(procs, tmp_path):
    coord = procs.coord(hb_ms=HB)
    for args in (["job", "-1"], ["job", "0"], ["job", "1x"], ["job", "18446744073709551615"],
                 ["cancel", "-1"], ["pause", "+-1"], ["checkpoints", "-1"],
                 ["metrics", "-1"], ["logbook", "-1", "--markdown"]):
        r = zctl(coord.grpc, *args, check=False)
        assert r.returncode != 0, (args, r.stdout)
        err = r.stderr
        assert "job id: expected an integer in 1..9223372036854775807" in err or \
            "usage: zctl" in err, (args, err)
        # Refused here, not by the coordinator ("not found").
        assert "unknown job" not in err, (args, err)


def test_zctl_usage_shows_every_verb_whole():
    """zctl's usage names every verb with all of its arguments: a verb
    whose arguments are wider than the column has its help on the next
    line, not its arguments cut off."""
    import subprocess
    from ztest import BIN
    r = subprocess.run([f"{BIN}/zctl", "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for whole in ("export JOB [--step S] --out DIR [--dtype f32|bf16] [--tokenizer REC] "
                  "[--adapter | --merge [--base PATH]]",
                  "sample JOB [--step S] --prompt TEXT [--tokens N] [--temperature T] [--top-k K] "
                  "[--seed N]"):
        assert f"  {whole}\n" in r.stdout, r.stdout
