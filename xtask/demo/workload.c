/* mtrace's demo workload: a small word-frequency indexer with several
 * allocation sites of different shapes.
 *
 *   - hash_insert: one malloc per distinct word (a node), plus strdup
 *   - vec_push:    a growing array (realloc, doubling)
 *   - make_matrix: calloc of a zeroed table
 *   - scratch:     short-lived buffers in a hot loop (malloc + free)
 *   - tokenize:    per-line token buffers at a deeper stack
 *
 * Built by `cargo xtask demo` with -O2 -fno-omit-frame-pointer -g. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NOINLINE __attribute__((noinline))

struct node {
    char *word;
    unsigned count;
    struct node *next;
};

struct vec {
    unsigned *items;
    size_t len, cap;
};

#define BUCKETS 4096
static struct node *table[BUCKETS];
static unsigned long checksum;

static unsigned hash(const char *s) {
    unsigned h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

NOINLINE static struct node *hash_insert(const char *word) {
    unsigned b = hash(word) % BUCKETS;
    for (struct node *n = table[b]; n; n = n->next)
        if (strcmp(n->word, word) == 0) {
            n->count++;
            return n;
        }
    struct node *n = malloc(sizeof *n);
    n->word = strdup(word);
    n->count = 1;
    n->next = table[b];
    table[b] = n;
    return n;
}

NOINLINE static void vec_push(struct vec *v, unsigned x) {
    if (v->len == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 4;
        v->items = realloc(v->items, v->cap * sizeof *v->items);
    }
    v->items[v->len++] = x;
}

NOINLINE static unsigned *make_matrix(size_t n) {
    return calloc(n * n, sizeof(unsigned));
}

NOINLINE static void scratch(const char *word) {
    size_t len = strlen(word);
    char *buf = malloc(len + 1);
    for (size_t i = 0; i < len; i++)
        buf[i] = word[len - 1 - i];
    buf[len] = 0;
    checksum += (unsigned char)buf[0];
    free(buf);
}

NOINLINE static char **tokenize(const char *line, size_t *count) {
    char **tokens = malloc(16 * sizeof(char *));
    char *copy = strdup(line);
    size_t n = 0;
    for (char *tok = strtok(copy, " "); tok && n < 16; tok = strtok(NULL, " "))
        tokens[n++] = tok;
    *count = n;
    return tokens; /* tokens[0] points into copy: freed together below */
}

NOINLINE static void index_line(const char *line, struct vec *lengths) {
    size_t n;
    char **tokens = tokenize(line, &n);
    for (size_t i = 0; i < n; i++) {
        hash_insert(tokens[i]);
        scratch(tokens[i]);
        vec_push(lengths, (unsigned)strlen(tokens[i]));
    }
    if (n)
        free(tokens[0]);
    free(tokens);
}

NOINLINE static void run(int lines) {
    static const char *words[] = {"alloc", "free", "stack", "heap", "probe", "kernel",
                                  "uprobe", "frame", "caller", "bytes", "count", "trace"};
    struct vec lengths = {0};
    char line[256];
    unsigned seed = 42;
    for (int l = 0; l < lines; l++) {
        size_t pos = 0;
        for (int w = 0; w < 8; w++) {
            seed = seed * 1103515245u + 12345u;
            const char *word = words[(seed >> 16) % 12];
            pos += (size_t)snprintf(line + pos, sizeof line - pos, "%s%u ", word, (seed >> 8) % 50);
        }
        index_line(line, &lengths);
    }
    unsigned *m = make_matrix(64);
    for (size_t i = 0; i < lengths.len; i++)
        m[lengths.items[i] % (64 * 64)]++;
    checksum += m[5] + lengths.len;
    free(m);
    free(lengths.items);
}

int main(int argc, char **argv) {
    int lines = argc > 1 ? atoi(argv[1]) : 2000;
    run(lines);
    printf("indexed %d lines, checksum %lu\n", lines, checksum);
    return 0;
}
