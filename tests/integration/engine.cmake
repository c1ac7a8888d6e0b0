# tests/integration/engine.cmake: zprep and zsolo end to end.
zt_py_test(engine_zprep test_engine_zprep.py TIMEOUT 300)
zt_py_test(engine_solo test_engine_solo.py TIMEOUT 600)
