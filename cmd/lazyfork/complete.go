package main

import (
	"context"
	"slices"
	"sort"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/spf13/cobra"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/client"
)

// completionTimeout bounds what shell completion asks containerd: a TAB
// press must not hang when containerd is down or stuck.
var completionTimeout = 2 * time.Second

// nameCompletion completes container names for a command whose synopsis
// (args) starts with NAME (NAME... : every argument is one); nil for others.
func (x *cli) nameCompletion(args string) cobra.CompletionFunc {
	first := ""
	for _, f := range strings.Fields(args) {
		if !strings.HasPrefix(f, "[") && !strings.HasPrefix(f, "-") {
			first = f
			break
		}
	}
	if !strings.HasPrefix(first, "NAME") {
		return nil
	}
	many := strings.HasSuffix(first, "...")
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		// After "--": the container's command line. (Not ArgsLenAtDash:
		// cobra parses for completion with a "--" appended.)
		if n := len(x.args); n > 0 && slices.Contains(x.args[:n-1], "--") {
			return nil, cobra.ShellCompDirectiveDefault
		}
		if len(args) > 0 && !many {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return x.containerNames(toComplete, args), cobra.ShellCompDirectiveNoFileComp
	}
}

// containerNames lists the containers lazyfork would act on (LazyFork's,
// or all with --all-runtimes) whose name starts with prefix, as "NAME\tID
// IMAGE" (a container without a name: "ID\tIMAGE"), but not those already
// given (skip). Nothing after completionTimeout.
func (x *cli) containerNames(prefix string, skip []string) []cobra.Completion {
	return withTimeout(func(ctx context.Context, cd *containerd.Client) []cobra.Completion {
		ctrs, err := cd.Containers(ctx)
		if err != nil {
			return nil
		}
		given := map[string]bool{}
		for _, s := range skip {
			given[s] = true
		}
		var out []cobra.Completion
		for _, c := range ctrs {
			info, err := c.Info(ctx, containerd.WithoutRefreshedMetadata)
			if err != nil || (!x.g.allRuntimes && info.Runtime.Name != api.RuntimeName) {
				continue
			}
			name := info.Labels[api.LabelName]
			if name == "" {
				name = info.Labels[client.LabelNerdctlName]
			}
			if name == "" {
				name = info.ID
			}
			if !strings.HasPrefix(name, prefix) || given[name] {
				continue
			}
			desc := info.Image
			if name != info.ID {
				desc = short(info.ID, 12) + " " + desc
			}
			out = append(out, cobra.CompletionWithDesc(name, desc))
		}
		sort.Strings(out)
		return out
	}, x.g)
}

// completeNamespaces completes --namespace with containerd's namespaces.
func (x *cli) completeNamespaces(_ *cobra.Command, _ []string, prefix string) ([]cobra.Completion, cobra.ShellCompDirective) {
	return withTimeout(func(ctx context.Context, cd *containerd.Client) []cobra.Completion {
		nss, err := cd.NamespaceService().List(ctx)
		if err != nil {
			return nil
		}
		var out []cobra.Completion
		for _, ns := range nss {
			if strings.HasPrefix(ns, prefix) {
				out = append(out, ns)
			}
		}
		return out
	}, x.g), cobra.ShellCompDirectiveNoFileComp
}

// withTimeout runs f against containerd at g.address, and gives up (nil)
// after completionTimeout even if containerd never answers.
func withTimeout(f func(context.Context, *containerd.Client) []cobra.Completion, g globals) []cobra.Completion {
	ctx, cancel := context.WithTimeout(context.Background(), completionTimeout)
	defer cancel()
	ch := make(chan []cobra.Completion, 1)
	go func() {
		cd, err := connect(g, containerd.WithTimeout(completionTimeout))
		if err != nil {
			ch <- nil
			return
		}
		defer cd.Close()
		ch <- f(namespaces.WithNamespace(ctx, g.namespace), cd)
	}()
	select {
	case out := <-ch:
		return out
	case <-ctx.Done():
		return nil
	}
}
