zt_py_test(http test_http.py)
zt_py_test(grpc_python test_grpc_python.py)
zt_py_test(dashboard test_dashboard.py)
