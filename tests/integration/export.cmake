zt_py_test(export test_export.py)
