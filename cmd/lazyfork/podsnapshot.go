package main

import (
	"context"
	"flag"
	"fmt"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
)

// CRI's labels on a pod's containers (set by kubelet).
const (
	labelPodNamespace = "io.kubernetes.pod.namespace"
	labelPodName      = "io.kubernetes.pod.name"
	labelContainer    = "io.kubernetes.container.name"
	// CRI's own annotation of a container's pod namespace, and the parent's
	// opt-in to forks by pods (shim.AnnotationForkable).
	annotationSandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
	annotationForkable         = "lazyfork.io/forkable"
)

// pod-snapshot serves the shim: a pod annotated lazyfork.io/fork-of with a
// running container's name. It runs as its own process so that the shim,
// one per family and long-lived, does not carry a containerd client.
func init() {
	var upper, forPodNS string
	register(&command{
		name:   "pod-snapshot",
		args:   "--upper DIR [--for-pod-namespace NS] REF",
		hidden: true,
		short:  "(for the shim) snapshot running container REF (an id, or NAMESPACE/POD/CONTAINER) for a fork whose rootfs has upper directory DIR; print the image directory",
		example: `  # what the shim runs for a pod annotated lazyfork.io/fork-of: default/web/app
  lazyfork --namespace k8s.io pod-snapshot --upper /var/lib/.../snapshots/42/fs default/web/app`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&upper, "upper", "", "the fork's upper directory, which gets the parent's writable layer")
			fs.StringVar(&forPodNS, "for-pod-namespace", "", "the fork is a pod of this Kubernetes namespace: the parent must be in it and carry lazyfork.io/forkable=true")
		},
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 1, "REF"); err != nil {
				return err
			}
			if upper == "" {
				return fmt.Errorf("--upper is required: %w", errdefs.ErrInvalidArgument)
			}
			id, err := runningContainer(a.ctx, a.cd, pos[0])
			if err != nil {
				return err
			}
			if forPodNS != "" {
				// Checked before the parent is paused or dumped.
				if err := podMayFork(a.ctx, a.cd, id, forPodNS); err != nil {
					return err
				}
			}
			image, err := a.lf.SnapshotForRootfs(a.ctx, id, upper)
			if err != nil {
				return err
			}
			fmt.Fprintln(a.out, image)
			return nil
		},
	})
}

// pod-layer serves the shim too: a pod annotated lazyfork.io/fork-of with a
// kept snapshot directory gets the parent's writable layer that snapshot
// recorded.
func init() {
	var upper string
	register(&command{
		name:   "pod-layer",
		args:   "--upper DIR IMAGE_DIR",
		hidden: true,
		short:  "(for the shim) copy the writable layer the snapshot IMAGE_DIR recorded into a fork's upper directory DIR",
		example: `  # what the shim runs for a pod annotated lazyfork.io/fork-of: /run/lazyfork/snapshots/x/image
  lazyfork pod-layer --upper /var/lib/.../snapshots/42/fs /run/lazyfork/snapshots/x/image`,
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&upper, "upper", "", "the fork's upper directory, which gets the parent's writable layer")
		},
		run: func(a *app, fs *flag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 1, "IMAGE_DIR"); err != nil {
				return err
			}
			if upper == "" {
				return fmt.Errorf("--upper is required: %w", errdefs.ErrInvalidArgument)
			}
			return a.lf.CopySnapshotLayer(a.ctx, pos[0], upper)
		},
	})
}

// podMayFork checks that a pod of Kubernetes namespace podNS may fork
// container id: the parent's pod is in the same namespace and opted in with
// lazyfork.io/forkable=true (the shim checks the snapshot's record again).
func podMayFork(ctx context.Context, cd *containerd.Client, id, podNS string) error {
	ctr, err := cd.LoadContainer(ctx, id)
	if err != nil {
		return err
	}
	spec, err := ctr.Spec(ctx)
	if err != nil {
		return err
	}
	if got := spec.Annotations[annotationSandboxNamespace]; got != podNS {
		return fmt.Errorf("a pod of Kubernetes namespace %q cannot fork container %s of namespace %q: %w", podNS, id, got, errdefs.ErrPermissionDenied)
	}
	if spec.Annotations[annotationForkable] != "true" {
		return fmt.Errorf("container %s did not opt in to forks by pods (annotation %s=true on its pod): %w", id, annotationForkable, errdefs.ErrPermissionDenied)
	}
	return nil
}

// runningContainer resolves a container id, or NAMESPACE/POD/CONTAINER, to the
// id of a container of that name with a running task.
func runningContainer(ctx context.Context, cd *containerd.Client, ref string) (string, error) {
	parts := strings.Split(ref, "/")
	switch len(parts) {
	case 1:
		return ref, nil
	case 3:
	default:
		return "", fmt.Errorf("%q: want a container id or NAMESPACE/POD/CONTAINER: %w", ref, errdefs.ErrInvalidArgument)
	}
	filter := fmt.Sprintf(`labels.%q==%q,labels.%q==%q,labels.%q==%q`,
		labelPodNamespace, parts[0], labelPodName, parts[1], labelContainer, parts[2])
	ctrs, err := cd.Containers(ctx, filter)
	if err != nil {
		return "", err
	}
	var running []string
	for _, c := range ctrs {
		t, err := c.Task(ctx, nil)
		if err != nil {
			continue
		}
		if st, err := t.Status(ctx); err == nil && st.Status == containerd.Running {
			running = append(running, c.ID())
		}
	}
	switch len(running) {
	case 1:
		return running[0], nil
	case 0:
		return "", fmt.Errorf("no running container %s in pod %s/%s (%d by that name): %w", parts[2], parts[0], parts[1], len(ctrs), errdefs.ErrNotFound)
	}
	return "", fmt.Errorf("%d running containers %s in pod %s/%s: %w", len(running), parts[2], parts[0], parts[1], errdefs.ErrFailedPrecondition)
}
