##@ Tools

# Microsoft's Azurite (Azure Blob emulator) for tests/integration/test_checkpoint_object_stores.py,
# installed from npm into the project's tool folder (no global install), version pinned. Its GCS
# counterpart, gcp-storage-emulator, is a Python package pinned in requirements/dev.txt.
AZURITE_VERSION   ?= 3.37.0
AZURITE_DIR        = $(TOOLS_DIR)/azurite-$(AZURITE_VERSION)
AZURITE_BLOB       = $(AZURITE_DIR)/node_modules/.bin/azurite-blob

.PHONY: azurite-tools
azurite-tools: $(AZURITE_BLOB) ## Install Azurite (Azure Blob emulator) from npm into .tools/azurite-<version>.

$(AZURITE_BLOB):
	@command -v npm >/dev/null || { echo "npm is missing: apt-get install nodejs npm (Azurite runs on Node.js >= 18)" >&2; exit 1; }
	@mkdir -p "$(AZURITE_DIR)"
	@cd "$(AZURITE_DIR)" && npm install --no-audit --no-fund --silent --no-save "azurite@$(AZURITE_VERSION)" \
	  || { echo "npm install azurite@$(AZURITE_VERSION) failed: set AZURITE_VERSION to one 'npm view azurite versions' lists" >&2; exit 1; }
	@test -x "$@"
	@echo "azurite-blob in $(AZURITE_DIR)/node_modules/.bin"

# tests/integration/test_checkpoint_object_stores.py starts Azurite from there.
test-python: azurite-tools
