package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/kumiko/kumiko-lifecycle-demo/scripts/internal/loadtool"
)

// target is one request to send, in vegeta's JSON target format (body in
// base64), so the script's targets file works with either tool.
type target struct {
	Method string      `json:"method"`
	URL    string      `json:"url"`
	Body   []byte      `json:"body"`
	Header http.Header `json:"header"`
}

// result is one request as the client saw it: one JSON line in the results file.
type result struct {
	Start  time.Time `json:"start"`
	End    time.Time `json:"end"` // the answer's body read, or the error
	Status int       `json:"status,omitempty"`
	Error  string    `json:"error,omitempty"`
	// Reused: the last connection the request went out on had served an
	// earlier request (httptrace GotConn.Reused); false for a new connection,
	// and for a request whose dial failed.
	Reused bool `json:"reused"`
	// Conns is how many connections net/http tried: above 1, it sent the
	// request again on another after a reused one had been closed under it
	// (an idempotent request on which nothing had been written).
	Conns int `json:"conns"`
	// Of a failed answer only: the instance the load balancer sent it to (its
	// X-Served-By header, absent when the balancer answered itself) and the
	// start of the body, whose error code tells a draining instance's 503
	// from a dependency's timeout or the balancer's own page.
	Server string `json:"server,omitempty"`
	Body   string `json:"body,omitempty"`
}

func (r result) failed() bool { return r.Status < 200 || r.Status > 299 }

func attack(args []string) error {
	fs := flag.NewFlagSet("attack", flag.ContinueOnError)
	rate := fs.Int("rate", 500, "requests per second; 0 sends none and waits for the end")
	duration := fs.Duration("duration", 0, "how long to send; 0: until SIGINT or SIGTERM")
	targetsPath := fs.String("targets", "", "targets, one JSON object a line: method, url, body (base64), header")
	out := fs.String("out", "", "results file, one JSON object a request")
	timeout := fs.Duration("timeout", 10*time.Second, "one request, connection included")
	conns := fs.Int("connections", 10000, "idle keep-alive connections kept to the host (vegeta's default)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || (*targetsPath == "" && *rate > 0) || *rate < 0 {
		return errors.New("attack needs -out, and -targets unless -rate is 0")
	}
	var targets []target
	if *rate > 0 {
		var err error
		if targets, err = readTargets(*targetsPath); err != nil {
			return err
		}
	}

	f, err := os.Create(*out)
	if err != nil {
		return fmt.Errorf("creating the results file: %w", err)
	}
	defer f.Close()
	w := bufio.NewWriter(f)

	// The load ends at the duration or when the script says so (SIGINT, like vegeta).
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *duration)
		defer cancel()
	}

	client := &http.Client{
		Timeout: *timeout,
		Transport: &http.Transport{
			MaxIdleConnsPerHost: *conns,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
			ForceAttemptHTTP2:   false,
		},
	}
	results := make(chan result, 1024)
	var sent sync.WaitGroup
	written := make(chan error, 1)
	go func() { written <- writeResults(w, results) }()

	if *rate == 0 {
		<-ctx.Done()
	} else {
		// An open model, like vegeta's: request i leaves at begin + i/rate
		// whether or not the earlier ones have answered, so a slow instance
		// cannot slow the load down and hide its failures.
		interval := time.Second / time.Duration(*rate)
		begin := time.Now()
		for i := 0; ; i++ {
			if err := loadtool.SleepUntil(ctx, begin.Add(time.Duration(i)*interval)); err != nil {
				break
			}
			t := targets[i%len(targets)]
			sent.Go(func() { results <- send(client, t) })
		}
	}
	sent.Wait()
	close(results)
	if err := <-written; err != nil {
		return fmt.Errorf("writing the results: %w", err)
	}
	return nil
}

// send sends one request and reads its answer.
func send(client *http.Client, t target) result {
	var r result
	trace := &httptrace.ClientTrace{
		// Each connection net/http tries starts with GetConn: a request it
		// sends again on a new connection is counted as new.
		GetConn: func(string) { r.Conns++; r.Reused = false },
		GotConn: func(info httptrace.GotConnInfo) { r.Reused = info.Reused },
	}
	var body io.Reader
	if t.Body != nil {
		body = bytes.NewReader(t.Body)
	}
	r.Start = time.Now()
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), t.Method, t.URL, body)
	if err != nil {
		r.End, r.Error = time.Now(), err.Error()
		return r
	}
	for k, v := range t.Header {
		req.Header[k] = v
	}
	resp, err := client.Do(req)
	if err == nil {
		r.Status = resp.StatusCode
		if r.failed() {
			head := make([]byte, bodyKept)
			n, _ := io.ReadFull(resp.Body, head)
			r.Server, r.Body = resp.Header.Get("X-Served-By"), string(head[:n])
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	r.End = time.Now()
	if err != nil {
		r.Status, r.Error = 0, err.Error()
	}
	return r
}

// bodyKept is how much of a failed answer's body is kept: enough for the
// service's error code, or the title of the balancer's error page.
const bodyKept = 120

func writeResults(w *bufio.Writer, results <-chan result) error {
	enc := json.NewEncoder(w)
	var err error
	for r := range results {
		if err == nil {
			err = enc.Encode(r)
		}
	}
	return errors.Join(err, w.Flush())
}

func readTargets(path string) ([]target, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading the targets: %w", err)
	}
	var targets []target
	dec := json.NewDecoder(bytes.NewReader(raw))
	for dec.More() {
		var t target
		if err := dec.Decode(&t); err != nil {
			return nil, fmt.Errorf("target %d in %s: %w", len(targets)+1, path, err)
		}
		if t.Method == "" {
			t.Method = http.MethodGet
		}
		targets = append(targets, t)
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("no targets in %s", path)
	}
	return targets, nil
}
