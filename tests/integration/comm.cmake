zt_py_test(comm_fault test_comm_fault.py)
