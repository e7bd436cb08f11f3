package main

import (
	"io"
	"net/http"
	"testing"
)

// HEAD answers like GET on the health routes and the page, on both ports:
// the same status and headers, no body (issue 20: they were 405).
func TestHeadAnswersLikeGet(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	for _, url := range []string{apiURL(s) + "/", apiURL(s) + "/health", apiURL(s) + "/health/ready", opsURL(s) + "/health", opsURL(s) + "/health/ready"} {
		get, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, get.Body)
		get.Body.Close()
		head, err := http.Head(url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(head.Body)
		head.Body.Close()
		if head.StatusCode != get.StatusCode || head.Header.Get("Content-Type") != get.Header.Get("Content-Type") || len(body) != 0 {
			t.Errorf("HEAD %s = %d %q with %d body bytes; GET = %d %q", url, head.StatusCode, head.Header.Get("Content-Type"), len(body), get.StatusCode, get.Header.Get("Content-Type"))
		}
	}
}
