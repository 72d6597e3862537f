terraform {
  # Provider-free on purpose: everything here runs under `terraform test`
  # offline. 1.6 is the first release with `terraform test`.
  required_version = ">= 1.6"
}
