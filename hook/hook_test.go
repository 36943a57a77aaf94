package hook

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestQuiesceReseed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), SocketName)
	var got []string
	srv, err := Listen(sock, Funcs{
		OnQuiesce: func(context.Context) error { got = append(got, "QUIESCE"); return nil },
		OnReseed: func(_ context.Context, id string) error {
			got = append(got, "RESEED "+id)
			if id == "bad" {
				return errors.New("cannot")
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve()
	defer srv.Close()
	ctx := context.Background()
	if err := Quiesce(ctx, sock, 0); err != nil {
		t.Fatal(err)
	}
	if err := Reseed(ctx, sock, "fork-1", 0); err != nil {
		t.Fatal(err)
	}
	if err := Reseed(ctx, sock, "bad", 0); err == nil || !strings.Contains(err.Error(), "cannot") {
		t.Fatalf("error answer: %v", err)
	}
	if strings.Join(got, ",") != "QUIESCE,RESEED fork-1,RESEED bad" {
		t.Fatalf("runtime saw %v", got)
	}
}

func TestBoundedWait(t *testing.T) {
	sock := filepath.Join(t.TempDir(), SocketName)
	srv, err := Listen(sock, Funcs{OnQuiesce: func(context.Context) error { time.Sleep(2 * time.Second); return nil }})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve()
	defer srv.Close()
	if err := Quiesce(context.Background(), sock, 200*time.Millisecond); err == nil {
		t.Fatal("a runtime that does not answer in time must fail the wait")
	}
	if err := Quiesce(context.Background(), filepath.Join(t.TempDir(), "none"), 100*time.Millisecond); err == nil {
		t.Fatal("no socket must fail")
	}
}
