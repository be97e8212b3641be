/* openapi_blob.S - embeds openapi.yaml (path given by -DOPENAPI_PATH). */
    .section .rodata
    .global md_openapi_start
    .global md_openapi_end
md_openapi_start:
    .incbin OPENAPI_PATH
md_openapi_end:
    .byte 0
    .section .note.GNU-stack,"",@progbits
