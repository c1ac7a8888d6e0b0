zt_py_test(elastic test_elastic.py TIMEOUT 1500)
