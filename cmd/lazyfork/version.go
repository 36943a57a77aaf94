package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/api"
)

// version is set at build time: go build -ldflags "-X main.version=v1.2.3"
// (make build sets it from git describe). Without it, the module version or
// VCS revision from the build info.
var version string

func init() {
	register(&command{
		name:    "version",
		short:   "print lazyfork's version (also lazyfork --version)",
		example: `  lazyfork version`,
		noConn:  true,
		run: func(a *app, fs *pflag.FlagSet, pos, _ []string) error {
			if err := needArgs(pos, 0, "no arguments"); err != nil {
				return err
			}
			fmt.Fprintf(a.out, "lazyfork version %s\n  go:      %s %s/%s\n  runtime: %s\n",
				versionString(), runtime.Version(), runtime.GOOS, runtime.GOARCH, api.RuntimeName)
			return nil
		},
	})
}

// versionString is lazyfork's version: -X main.version, else the module's
// version, else "devel" with the VCS revision when the build recorded one.
func versionString() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	v, dirty := "devel", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v += "-" + short(s.Value, 12)
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty {
		v += "-dirty"
	}
	return v
}
