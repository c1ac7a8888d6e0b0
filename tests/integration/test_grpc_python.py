"""A gRPC client not written in C: Python grpcio (Debian's python3-grpcio)
with stubs generated here from proto/ztrain.proto (grpc_tools, Debian's
python3-grpc-tools) lists workers and submits a job."""
import json
import os
import subprocess
import sys

import grpc
import pytest

from ztest import SRC, byte_dataset, tiny_spec, wait_until, workers_by_name


def stubs(tmp):
    out = str(tmp / "gen")
    os.makedirs(out, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{SRC}/proto",
                        f"--python_out={out}", f"--grpc_python_out={out}",
                        f"{SRC}/proto/ztrain.proto"], capture_output=True, text=True)
    if r.returncode != 0 and "No module named grpc_tools" in r.stderr:
        pytest.skip("python3-grpc-tools is not installed")
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, out)
    import ztrain_pb2
    import ztrain_pb2_grpc
    return ztrain_pb2, ztrain_pb2_grpc


def test_python_client_lists_workers_and_submits(procs, tmp_path):
    pb, pbg = stubs(tmp_path)
    train, val = byte_dataset(str(tmp_path / "data"), 150_000)
    coord = procs.coord(hb_ms=300, extra=["--api-token", "tok"])
    for i in range(2):
        procs.worker(coord.grpc, f"py{i}", extra=["--threads", "1"])
    wait_until(lambda: len(workers_by_name(coord)) == 2, 20, "workers")
    with grpc.insecure_channel(coord.grpc) as ch:
        status = pbg.StatusStub(ch)
        ws = status.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        assert sorted(w.name for w in ws) == ["py0", "py1"]
        assert all(w.state == pb.WORKER_ALIVE for w in ws)
        spec = json.dumps(tiny_spec(train, val, 20, stage=1, workers=2))
        with pytest.raises(grpc.RpcError) as e:
            status.SubmitJob(pb.SubmitJobRequest(spec_json=spec), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        r = status.SubmitJob(pb.SubmitJobRequest(spec_json=spec), timeout=5,
                             metadata=[("authorization", "Bearer tok")])
        assert r.job_id > 0

        def done():
            j = status.GetJob(pb.GetJobRequest(job_id=r.job_id), timeout=5).job
            return j if j.state == pb.JOB_COMPLETED else None
        j = wait_until(done, 120, "job completed")
        assert j.step == 20 and j.world == 2
        steps = status.GetMetrics(pb.GetMetricsRequest(job_id=r.job_id), timeout=5).steps
        assert [s.step for s in steps] == list(range(1, 21))
        with pytest.raises(grpc.RpcError) as e:
            status.SubmitJob(pb.SubmitJobRequest(spec_json='{"steps": 1, "bogus": 2}'),
                             timeout=5, metadata=[("authorization", "Bearer tok")])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bogus" in e.value.details()
