# Makefile: the two set-up commands of ztrain, wrapping CMake.
#
#   make demo   install what is missing, build, run a small training job
#   make test   install what is missing, build, run every test (then the
#               unit tests again under ASan+UBSan)
#
# Other targets: build, deps, test-asan (every test under the sanitizers),
# bench, clean.
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps build build-asan test test-unit-asan test-asan demo bench clean

all: build

deps:
	bash deploy/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

build-asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DZT_SANITIZE=ON -DZT_WITH_CUDA=OFF $(CMAKE_ARGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# Integration tests start several processes and assert timing bounds, so
# ctest runs one test at a time.
test: build
	cd $(BUILD) && ctest --output-on-failure
	$(MAKE) test-unit-asan

test-unit-asan: build-asan
	cd $(ASAN_BUILD) && ctest --output-on-failure -L unit

test-asan: build-asan
	cd $(ASAN_BUILD) && ctest --output-on-failure

demo: build
	bash examples/demo.sh $(BUILD)

bench: build
	bench/heartbeats $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
