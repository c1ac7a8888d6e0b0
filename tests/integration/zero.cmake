zt_py_test(zero test_zero.py TIMEOUT 900)
