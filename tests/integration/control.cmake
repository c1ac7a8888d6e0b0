zt_py_test(control test_control.py)
zt_py_test(rpc_robustness test_rpc_robustness.py)
zt_py_test(systemd test_systemd.py)
