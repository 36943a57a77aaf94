//go:build godeps

// Package godeps pins, during bootstrap, the modules the project is built on.
package godeps

import (
	_ "github.com/checkpoint-restore/checkpointctl/lib"
	_ "github.com/checkpoint-restore/go-criu/v7"
	_ "github.com/checkpoint-restore/go-criu/v7/crit/images/pagemap"
	_ "github.com/containerd/containerd/v2/client"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/process"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/runc"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	_ "github.com/containerd/containerd/v2/contrib/snapshotservice"
	_ "github.com/containerd/containerd/v2/core/snapshots/storage"
	_ "github.com/containerd/containerd/v2/core/snapshots/testsuite"
	_ "github.com/containerd/containerd/v2/pkg/shim"
	_ "github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	_ "github.com/containerd/ttrpc"
	_ "go.etcd.io/bbolt"
	_ "golang.org/x/sys/unix"
	_ "k8s.io/cri-api/pkg/apis/runtime/v1"
)
