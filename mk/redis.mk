##@ Tools

# Redis for Ray's GCS fault tolerance (`make cluster-up GCS_FT=1`): Debian bookworm's
# redis-server, unpacked into the project's tool folder like Prometheus (`apt-get download` +
# `dpkg -x`, no root install). The binary lives in redis-tools (redis-server is a link to it) and
# needs two libraries the image lacks, unpacked beside it: run it with
# LD_LIBRARY_PATH=$(REDIS_LIB_DIR) (runtime.cluster does). Versions pinned, as for Prometheus.
REDIS_DEB_VERSION     ?= 5:7.0.15-1~deb12u7
LIBLZF_DEB_VERSION    ?= 3.6-3
LIBJEMALLOC_DEB_VERSION ?= 5.3.0-1

REDIS_TOOLS_DIR = $(TOOLS_DIR)/redis
REDIS_SERVER    = $(REDIS_TOOLS_DIR)/usr/bin/redis-server
REDIS_LIB_DIR   = $(REDIS_TOOLS_DIR)/usr/lib/x86_64-linux-gnu
REDIS_TOOLS_STAMP = $(REDIS_TOOLS_DIR)/.stamp-$(subst :,_,$(REDIS_DEB_VERSION))-$(LIBLZF_DEB_VERSION)-$(LIBJEMALLOC_DEB_VERSION)

.PHONY: redis-tools
redis-tools: $(REDIS_TOOLS_STAMP) ## Unpack Debian's redis-server into .tools/redis (Ray GCS fault tolerance).

$(REDIS_TOOLS_STAMP):
	@debs="$(CACHE_DIR)/debs"; mkdir -p "$$debs" "$(REDIS_TOOLS_DIR)"
	@policy=$$(apt-cache policy redis-tools 2>/dev/null || true); \
	if [[ "$$policy" != *"Candidate:"* || "$$policy" == *"Candidate: (none)"* ]]; then \
	  echo "apt has no candidate for redis-tools: running apt-get update"; \
	  apt-get update -qq; \
	fi
	@cd "$(CACHE_DIR)/debs" && for spec in 'redis-tools=$(REDIS_DEB_VERSION)' 'redis-server=$(REDIS_DEB_VERSION)' \
	    'liblzf1=$(LIBLZF_DEB_VERSION)' 'libjemalloc2=$(LIBJEMALLOC_DEB_VERSION)'; do \
	  pkg=$${spec%%=*}; ver=$${spec#*=}; \
	  deb=$$(ls "$${pkg}_$${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true); \
	  if [ -z "$$deb" ]; then \
	    apt-get download -q -o APT::Sandbox::User=root "$$spec" \
	      || { echo "apt-get download $$spec failed: set REDIS_DEB_VERSION / LIBLZF_DEB_VERSION / LIBJEMALLOC_DEB_VERSION to a version 'apt-cache policy $$pkg' lists" >&2; exit 1; }; \
	    deb=$$(ls "$${pkg}_$${ver//:/%3a}_"*.deb | head -n1); \
	  fi; \
	  dpkg -x "$$deb" "$(REDIS_TOOLS_DIR)"; \
	done
	@LD_LIBRARY_PATH="$(REDIS_LIB_DIR)" "$(REDIS_SERVER)" --version >/dev/null
	@rm -f "$(REDIS_TOOLS_DIR)"/.stamp-*
	@touch "$@"
	@echo "redis-server in $(REDIS_TOOLS_DIR)/usr/bin"

# `make cluster-up GCS_FT=1`: Redis first, and runtime.cluster starts the head with it.
ifeq ($(GCS_FT),1)
cluster-up: redis-tools
export RT_GCS_FT := 1
endif

# tests/integration/test_gcs_restart.py restarts a GCS backed by this Redis.
test-python: redis-tools
