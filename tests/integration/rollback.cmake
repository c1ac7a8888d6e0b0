zt_py_test(rollback test_rollback.py TIMEOUT 900)
