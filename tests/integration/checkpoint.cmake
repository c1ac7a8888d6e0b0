zt_py_test(checkpoint test_checkpoint.py TIMEOUT 900)
