terraform {
  # 1.9: cluster_spec's validations compare variables with each other.
  required_version = ">= 1.9"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.60, < 7.0"
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ "gpu-cluster:name" = var.cluster_name, ManagedBy = "terraform" }, var.tags)
  }
}
