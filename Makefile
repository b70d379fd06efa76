# Shepherd's build, test and code generation. `make test` is the one test
# command (the README says so and .ci/run calls it).

GO            ?= go
TOOLS         := $(CURDIR)/.tools
SQLC_VERSION  := v1.31.1
STATICCHECK_VERSION := v0.8.2
BUF_VERSION   := v1.75.0
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_CONNECT_GO_VERSION := v1.21.1
GREMLINS_VERSION := v0.6.0
SQLC          := $(TOOLS)/sqlc-$(SQLC_VERSION)/sqlc
STATICCHECK   := $(TOOLS)/staticcheck-$(STATICCHECK_VERSION)/staticcheck
BUF           := $(TOOLS)/buf-$(BUF_VERSION)/buf
# buf.gen.yaml names these paths; keep the versions in sync.
PROTOC_GEN_GO := $(TOOLS)/protoc-gen-go-$(PROTOC_GEN_GO_VERSION)/protoc-gen-go
PROTOC_GEN_CONNECT_GO := $(TOOLS)/protoc-gen-connect-go-$(PROTOC_GEN_CONNECT_GO_VERSION)/protoc-gen-connect-go
GREMLINS      := $(TOOLS)/gremlins-$(GREMLINS_VERSION)/gremlins

# Generated files, checked by `make generate-check`.
GENERATED := bmdb/queries/candidates.gen.sql bmdb/model api

.PHONY: all build test chaos mutate fuzz generate generate-check lint bench bench-memory dev tools require-postgres require-sshd require-chromium require-promtool require-openipmi require-redfish-clients require-systemd-analyze

all: build

# The agent is static and stripped: it is uploaded to every machine.
build:
	$(GO) build ./...
	$(GO) build -o bin/shepherd ./cmd/shepherd
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o bin/shepherd-agent ./cmd/shepherd-agent

require-postgres:
	@scripts/require-postgres

require-sshd:
	@scripts/require-sshd

require-chromium:
	@scripts/require-chromium

require-promtool:
	@scripts/require-promtool

require-openipmi:
	@scripts/require-openipmi

require-redfish-clients:
	@scripts/require-redfish-clients

require-systemd-analyze:
	@scripts/require-systemd-analyze

# Fuzz targets of the parsers of external input (SPEC §8 R9), each run by
# `make test` for FUZZTIME_DEFAULT inputs or the count after its second
# colon (a target whose inputs each cost a database round trip runs
# fewer); `make fuzz FUZZTIME=10m` runs every target for that long.
# The default is a count of inputs, not a duration: with a duration, Go
# 1.26's fuzz coordinator can report "context deadline exceeded" at the end
# of a clean run (golang/go#75804, fixed in Go 1.27), which made CI flaky.
FUZZTIME_DEFAULT := 20000x
FUZZTIME ?=
FUZZ_TARGETS := \
	./server:FuzzParseHeartbeat \
	./api/agent/pulse:FuzzParseRequest \
	./api/agent/pulse:FuzzOpenReply \
	./agent:FuzzTakeoverInit \
	./agent/hwreport:FuzzParseCPUInfo \
	./agent/hwreport:FuzzParseCPUList \
	./agent/hwreport:FuzzParseMemTotal \
	./provider/static:FuzzParse \
	./provider/equinix/metal:FuzzDecodeDevice \
	./provider/equinix/metal:FuzzDecodeDeviceList \
	./provider/equinix/metal:FuzzDecodeError \
	./web:FuzzPageQuery:1000x

# sshd is installed first, so the SSH end-to-end tests must use it: a
# missing sshd fails them rather than falling back to the in-process server.
test: require-postgres require-sshd require-chromium require-promtool require-openipmi require-redfish-clients require-systemd-analyze
	SHEPHERD_REQUIRE_SSHD=1 $(GO) test -race -count=1 -timeout 20m ./...
	$(MAKE) --no-print-directory fuzz

# The randomized fault soak (package chaos): CHAOS_DURATION of faults
# (default 5m), then every invariant checked; CHAOS_SEED replays a run.
# `make test` runs a short soak of its own.
CHAOS_DURATION ?= 5m
chaos: require-postgres require-sshd
	CHAOS_DURATION=$(CHAOS_DURATION) CHAOS_SEED=$(CHAOS_SEED) SHEPHERD_REQUIRE_SSHD=1 \
		$(GO) test -count=1 -v -timeout 0 -run '^TestChaos$$' ./chaos

# Mutation testing (gremlins, run by ./mutate): every package whose tests
# are held to efficacy >= 95 % and mutant coverage >= 80 %, or PKG=dir for
# one, and DIFF=ref to mutate only the lines changed since a git ref. It
# fails when a mutant lives that mutate/equivalent.txt does not explain.
# Too slow for `make test`: run it when changing one of those packages.
mutate: require-postgres require-sshd $(GREMLINS)
	SHEPHERD_REQUIRE_SSHD=1 $(GO) run ./mutate -gremlins $(GREMLINS) $(if $(DIFF),-diff $(DIFF)) $(if $(FILES),-files $(FILES)) $(PKG)

fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; rest=$${t#*:}; fn=$${rest%%:*}; ft=$${rest#"$$fn"}; ft=$${ft#:}; \
		if [ -n "$(FUZZTIME)" ]; then ft=$(FUZZTIME); fi; ft=$${ft:-$(FUZZTIME_DEFAULT)}; \
		echo "fuzzing $$fn in $$pkg, -fuzztime=$$ft"; \
		$(GO) test -run='^$$' -fuzz="^$$fn\$$" -fuzztime=$$ft $$pkg; \
	done

generate: $(SQLC) $(BUF) $(PROTOC_GEN_GO) $(PROTOC_GEN_CONNECT_GO)
	$(GO) run ./bmdb/internal/gencandidates -in bmdb/candidates -out bmdb/queries/candidates.gen.sql
	$(SQLC) generate
	$(BUF) lint
	$(BUF) generate

# Fails if the committed generated code differs from what `make generate`
# produces now.
generate-check: generate
	@if [ -n "$$(git status --porcelain -- $(GENERATED))" ]; then \
		echo "generated code is stale; run 'make generate' and commit the result:"; \
		git status --porcelain -- $(GENERATED); \
		git diff --stat -- $(GENERATED); \
		exit 1; \
	fi

# Besides the Go checks, no tracked file may look like a build product or
# exceed 1 MB (scripts/checkfiles).
lint: $(STATICCHECK)
	$(GO) run ./scripts/checkfiles
	@out=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...

bench: require-postgres
	$(GO) run ./bench

# P5 with the whole fleet of 100,000 agents heartbeating, rather than the
# 15,000 that make bench's ten minutes leave room for: the agents' first TLS
# heartbeats alone take about seven minutes at the pace this machine allows.
bench-memory: require-postgres
	BENCH_ONLY=P5 BENCH_P5_AGENTS=100000 $(GO) run ./bench

# The zero-setup development stack: a private PostgreSQL in a data
# directory, the callback server, a simulated fleet and every loop.
dev: require-postgres
	$(GO) run ./cmd/shepherd dev

tools: $(SQLC) $(STATICCHECK) $(BUF) $(PROTOC_GEN_GO) $(PROTOC_GEN_CONNECT_GO) $(GREMLINS)

$(SQLC):
	GOBIN=$(dir $@) $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)

$(GREMLINS):
	GOBIN=$(dir $@) $(GO) install github.com/go-gremlins/gremlins/cmd/gremlins@$(GREMLINS_VERSION)

$(STATICCHECK):
	GOBIN=$(dir $@) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

$(BUF):
	GOBIN=$(dir $@) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)

$(PROTOC_GEN_GO):
	GOBIN=$(dir $@) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

$(PROTOC_GEN_CONNECT_GO):
	GOBIN=$(dir $@) $(GO) install connectrpc.com/connect/cmd/protoc-gen-connect-go@$(PROTOC_GEN_CONNECT_GO_VERSION)
