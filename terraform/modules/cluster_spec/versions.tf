terraform {
  # Provider-free on purpose: everything here runs under `terraform test`
  # offline. 1.9 is the first release whose validations may read other
  # variables (admin_cidrs against admin_cidr_min_prefix_length).
  required_version = ">= 1.9"
}
