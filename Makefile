# LazyFork. `make help` lists the targets.
GO        ?= go
PREFIX    ?= /usr/local
DESTDIR   ?=
SYSTEMDDIR ?= /etc/systemd/system
BINDIR    := bin
GOTESTFLAGS ?=
# Root/real-stack tests share containerd, CRIU and cgroups: run packages one at a time.
INTEGRATION_FLAGS ?= -p 1 -count=1 -timeout 75m
# make zdtm: the test list, and more flags of ./zdtm (-run REGEXP, -keep, -out FILE)
ZDTM_LIST ?= zdtm/tests.list
ZDTM_FLAGS ?=
# zdtm.py's flavour: h (host namespaces) or ns (new pid/mount/net/ipc/uts namespaces)
ZDTM_FLAVOR ?= h

# The full shim before the front that runs it: an install never leaves a new
# front beside no full shim.
COMMANDS := containerd-shim-lazyfork-v1-full containerd-shim-lazyfork-v1 lazyfork-rehome lazyfork-snapshotter lazyfork lazyfork-memfile
# The CRIU proxy (one static C program, cmd/lazyfork-criu-proxy/proxy.c) is
# installed as `criu` and `tar` in a directory of its own beside the shims,
# which the shim puts first on runc's PATH (internal/criuproxy). C, not Go: it
# runs before every real CRIU and tar run, and Go's start-up costs 1.5-2 ms.
CRIU_PROXY := criu-proxy/criu
CRIU_PROXY_TAR := criu-proxy/tar
CRIU_PROXY_SRC := cmd/lazyfork-criu-proxy/proxy.c
PROXY_CC ?= gcc
# Static binaries, as pure Go: only net and os/user would use cgo (their Go
# versions read the same /etc files), and without a dynamic loader each start
# is 1-3 ms shorter on a 2-core EPYC guest: the full shim runs for every fresh
# container's shim and every hook or delete containerd asks of it.
GO_STATIC := CGO_ENABLED=0
# lazyfork --version (the go env here has -buildvcs=false: no VCS stamp in the build info)
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)

export PATH := $(PREFIX)/sbin:$(PREFIX)/bin:/usr/local/go/bin:$(PATH)

.PHONY: all help build criu-proxy install uninstall deps images test integration check demo \
	bench-baseline bench-memfile bench-fork bench-fork-100 bench-refork bench-snapshotter bench-allocators bench-rewrite bench-cirunner fidelity critest \
	proto proto-check lint clean zdtm zdtm-ci release cross-check

all: build

help: ## this list
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

build: ## build every binary into bin/
	@mkdir -p $(BINDIR)
	$(GO_STATIC) $(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BINDIR)/ $(addprefix ./cmd/,$(COMMANDS))
	$(MAKE) --no-print-directory criu-proxy OUT=$(BINDIR)
	ln -sf lazyfork $(BINDIR)/lfork

# criu-proxy OUT=dir: the CRIU proxy as dir/criu-proxy/criu and, linked, tar.
criu-proxy:
	@command -v $(PROXY_CC) >/dev/null || { echo "make: $(PROXY_CC) not found: the CRIU proxy ($(CRIU_PROXY_SRC)) needs a C compiler and a static libc: apt-get install build-essential (or make deps)" >&2; exit 1; }
	@mkdir -p $(OUT)/criu-proxy
	$(PROXY_CC) -static -O2 -s -Wall -o $(OUT)/$(CRIU_PROXY).tmp $(CRIU_PROXY_SRC) || { echo "make: $(PROXY_CC) -static failed: a static libc is needed: apt-get install build-essential (libc6-dev)" >&2; exit 1; }
	mv -f $(OUT)/$(CRIU_PROXY).tmp $(OUT)/$(CRIU_PROXY)
	ln -f $(OUT)/$(CRIU_PROXY) $(OUT)/$(CRIU_PROXY_TAR)

UNITS := lazyfork-snapshotter.service containerd.service.d/lazyfork.conf

install: build ## install the binaries into $(DESTDIR)$(PREFIX)/bin and the systemd units into $(DESTDIR)$(SYSTEMDDIR) (then: lazyfork setup)
	install -d $(DESTDIR)$(PREFIX)/bin
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin/criu-proxy
	install -m 0755 $(BINDIR)/$(CRIU_PROXY) $(DESTDIR)$(PREFIX)/bin/$(CRIU_PROXY)
	ln -f $(DESTDIR)$(PREFIX)/bin/$(CRIU_PROXY) $(DESTDIR)$(PREFIX)/bin/$(CRIU_PROXY_TAR)
	install -m 0755 $(addprefix $(BINDIR)/,$(COMMANDS)) $(DESTDIR)$(PREFIX)/bin/
	ln -sf lazyfork $(DESTDIR)$(PREFIX)/bin/lfork
	install -d $(DESTDIR)$(SYSTEMDDIR)/containerd.service.d
	for u in $(UNITS); do \
		sed 's|@PREFIX@|$(PREFIX)|g' deploy/systemd/$$u >$(DESTDIR)$(SYSTEMDDIR)/$$u.tmp && \
		chmod 0644 $(DESTDIR)$(SYSTEMDDIR)/$$u.tmp && mv $(DESTDIR)$(SYSTEMDDIR)/$$u.tmp $(DESTDIR)$(SYSTEMDDIR)/$$u || exit 1; \
	done
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

uninstall: ## remove what install put in place (run `lazyfork setup --down` first; docs/setup.md)
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl disable --now lazyfork-snapshotter.service || true; fi
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(COMMANDS) lfork $(CRIU_PROXY) $(CRIU_PROXY_TAR))
	-rmdir $(DESTDIR)$(PREFIX)/bin/criu-proxy 2>/dev/null
	rm -f $(addprefix $(DESTDIR)$(SYSTEMDDIR)/,$(UNITS))
	-rmdir $(DESTDIR)$(SYSTEMDDIR)/containerd.service.d 2>/dev/null
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

deps: ## install the stack (CRIU 4.1.1, containerd 2.4.2, runc, nerdctl, CNI), idempotently; root
	bash scripts/deps.sh

images: ## build the cached test images (busybox, python) as OCI archives
	bash scripts/images.sh

test: ## unit tests; no root needed (real-stack tests skip); bench/ is its own module
	$(GO) test $(GOTESTFLAGS) ./...
	$(GO) -C bench test $(GOTESTFLAGS) ./...

integration: build ## every test, including those needing root, CRIU and a real containerd
	LAZYFORK_INTEGRATION=1 LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) test $(INTEGRATION_FLAGS) $(GOTESTFLAGS) ./...
	LAZYFORK_INTEGRATION=1 LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) -C bench test $(INTEGRATION_FLAGS) $(GOTESTFLAGS) ./...

check: deps images lint cross-check integration critest zdtm-ci ## what CI runs: install what is missing, then every test, the CRI conformance suite and CRIU's zdtm subset

demo: deps images build ## the main job: a private stack, a running container forked (scripts/demo.sh)
	bash scripts/demo.sh

bench-baseline: ## plain runc checkpoint/restore of a 256 MB python container
	$(GO) -C bench run ./baseline

bench-memfile: ## memfile restore vs plain CRIU restore, 64 MiB..2 GiB heaps
	$(GO) -C bench run ./memfile -out $(CURDIR)/bench/results

bench-fork: build ## LazyFork fork vs plain restore through containerd
	LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) -C bench run ./fork

bench-fork-100: build ## 100 forks of a 256 MiB python container at once (no plain copies: 100 x 278 MB)
	LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) -C bench run ./fork -heaps 256 -forks 100 -plain-many-max 0 -out $(CURDIR)/bench/results/fork100

bench-refork: build ## ten successive forks of a running parent, moving onto its memory file vs opt-out (64 MiB..1 GiB)
	LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) -C bench run ./refork

bench-snapshotter: ## fork rootfs preparation vs per-fork copy of the upper layer
	$(GO) -C bench run ./snapshotter -out $(CURDIR)/bench/results

bench-cirunner: build ## CI jobs: cold container vs LazyFork fork (time to first test output, memory)
	LAZYFORK_BIN=$(CURDIR)/$(BINDIR) $(GO) -C bench run ./cirunner

bench-allocators: ## glibc, jemalloc, mimalloc in forks: failures, memory, madvise cost per guard mode
	$(GO) -C bench run ./allocators -out $(CURDIR)/bench/results

bench-rewrite: ## memfile rewrite throughput vs cp, restore vs plain CRIU (go test benchmarks)
	LAZYFORK_INTEGRATION=1 $(GO) test -run '^$$' -bench 'Rewrite|Restore' -benchtime 5x ./memfile

zdtm: ## CRIU's zdtm static tests three ways (plain, rewritten, fork of a fork): CSV + summary; root (ZDTM_LIST=zdtm/ci.list: the CI subset; ZDTM_FLAVOR=ns: in namespaces)
	$(GO) run ./zdtm -list $(ZDTM_LIST) -flavor $(ZDTM_FLAVOR) $(ZDTM_FLAGS)

zdtm-ci: ## the CI subset of make zdtm (zdtm/ci.list, about a minute once built)
	$(GO) run ./zdtm -list zdtm/ci.list -flavor $(ZDTM_FLAVOR) $(ZDTM_FLAGS)

fidelity: ## real-CRIU fidelity tests of the memfile rewrite on plain process trees (root)
	LAZYFORK_INTEGRATION=1 $(GO) test -count=1 -timeout 30m ./fidelity/

critest: build ## Kubernetes CRI validation suite (cri-tools v1.37.0), runc vs lazyfork handler side by side, offline (root; ~5 min, part of make check)
	bash scripts/critest.sh $(CURDIR)/$(BINDIR)/critest
	$(GO) run ./integration/harness/cmd/lfh-critest -critest $(CURDIR)/$(BINDIR)/critest -bin $(CURDIR)/$(BINDIR) $(CRITEST_FLAGS)

proto: ## regenerate proto/ stubs
	bash proto/generate.sh

proto-check: ## fail if the generated proto code is stale
	bash proto/check.sh

lint: ## gofmt and go vet (of both modules: the repository and bench/)
	@bad=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$bad" ]; then echo "gofmt needed:"; echo "$$bad"; exit 1; fi
	$(GO) vet ./...
	$(GO) -C bench vet ./...

# The node's commands run on Linux amd64 only (memfile/madvguard reads amd64
# registers); the CLI and SDK programs also build for macOS (lazyfork vm).
RELEASEDIR := dist
DARWIN_ARCHS := arm64 amd64

release: ## linux/amd64 binaries and the macOS lazyfork CLI (darwin/arm64, darwin/amd64) into dist/<os>-<arch>/
	@mkdir -p $(RELEASEDIR)/linux-amd64
	$(GO_STATIC) GOOS=linux GOARCH=amd64 $(GO) build -ldflags "-X main.version=$(VERSION)" -o $(RELEASEDIR)/linux-amd64/ $(addprefix ./cmd/,$(COMMANDS))
	$(MAKE) --no-print-directory criu-proxy OUT=$(RELEASEDIR)/linux-amd64
	for a in $(DARWIN_ARCHS); do \
		mkdir -p $(RELEASEDIR)/darwin-$$a && \
		CGO_ENABLED=0 GOOS=darwin GOARCH=$$a $(GO) build -ldflags "-X main.version=$(VERSION)" -o $(RELEASEDIR)/darwin-$$a/lazyfork ./cmd/lazyfork || exit 1; \
	done

cross-check: ## the CLI and the Go SDK compile for macOS (darwin/arm64, darwin/amd64)
	for a in $(DARWIN_ARCHS); do \
		CGO_ENABLED=0 GOOS=darwin GOARCH=$$a $(GO) build -o /dev/null ./cmd/lazyfork ./client/... ./node/... ./integration/remoteclient || exit 1; \
		CGO_ENABLED=0 GOOS=darwin GOARCH=$$a $(GO) vet ./cmd/lazyfork ./client ./node ./deploy/lima || exit 1; \
	done

clean: ## remove build outputs
	rm -rf $(BINDIR) $(RELEASEDIR)
